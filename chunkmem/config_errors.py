"""pydantic's validation errors as messages a user acts on: the key path, the bad value and
the reason, and for an unknown key the closest valid one."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError


def _section_at(location: tuple[Any, ...], root: type[BaseModel]) -> type[BaseModel] | None:
    """The model class that owns the key at ``location`` (None if not a model)."""
    model = root
    for part in location[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def describe_validation_error(
    exc: ValidationError,
    root: type[BaseModel],
    name: Callable[[str], str] = lambda key: f"config key {key!r}",
) -> str:
    """One line per error of validating ``root`` (``Config``, a run file's sections), naming the key
    (as ``name`` spells it), the value and the reason (for an unknown key, the closest valid
    one)."""
    lines = []
    for error in exc.errors():
        location = tuple(error["loc"])
        key = ".".join(str(part) for part in location) or "<root>"
        if error["type"] == "extra_forbidden":
            section = _section_at(location, root)
            valid = sorted(section.model_fields) if section else []
            close = difflib.get_close_matches(str(location[-1]), valid, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            lines.append(f"unknown {name(key)}: {hint}valid keys here are {valid}")
        elif not location:  # a check across keys: its message names them
            lines.append(str(error["msg"]).removeprefix("Value error, "))
        else:
            value = error.get("input")
            lines.append(
                f"{name(key)}: {error['msg']} (got {value!r} of type {type(value).__name__})"
            )
    return "invalid chunkmem config:\n  " + "\n  ".join(lines)
