"""Byte sizes as people write them in configs and on the command line: ``512MiB``, ``1.5GB``."""

from __future__ import annotations

import re
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_byte_size(value: Any) -> Any:
    """Accept an int or a string such as ``"512MiB"``/``"1.5GB"``; leave anything else to pydantic."""
    if isinstance(value, bool):
        raise ValueError("a byte size must be an integer or a string like '512MiB', not a bool")
    if isinstance(value, str):
        match = _SIZE_PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read {value!r} as a byte size; use an integer or a number with one of "
                f"the units {sorted(u for u in _UNITS if u)} (e.g. '512MiB')"
            )
        return int(float(match.group(1)) * _UNITS[unit])
    return value
