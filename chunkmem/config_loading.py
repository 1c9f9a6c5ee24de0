"""Loading a :class:`~chunkmem.config.Config` from what users hold: a dict (chunkmem's own, or
a DeepSpeed config), a JSON file, a Config or None, with errors that name the file or the key.

Split from ``chunkmem.config``, which keeps the schema and its rules; ``Config.from_dict``,
``Config.from_json`` and ``Config.coerce`` are the public names and call these.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from chunkmem.config_errors import describe_validation_error
from chunkmem.errors import ConfigError

if TYPE_CHECKING:
    from chunkmem.config import Config


def config_from_dict(cls: type[Config], data: dict[str, Any]) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a dict (JSON object), got {type(data).__name__}")
    if _is_deepspeed_config(data):
        from chunkmem.deepspeed_config import from_deepspeed

        return from_deepspeed(data)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, root=cls)) from None


def config_from_json(cls: type[Config], path: str | Path) -> Config:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text ({exc.reason} at byte "
            f"{exc.start}); save it as UTF-8 JSON"
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc}") from None
    return cls.from_dict(data)


def coerce_config(cls: type[Config], config: Config | dict[str, Any] | str | Path | None) -> Config:
    if config is None:
        return cls()
    if isinstance(config, cls):
        return config
    if isinstance(config, dict):
        return cls.from_dict(config)
    if isinstance(config, (str, Path)):
        return cls.from_json(config)
    raise ConfigError(
        f"config must be a chunkmem Config, a dict or a path to a JSON file, "
        f"got {type(config).__name__}"
    )


def _is_deepspeed_config(data: dict[str, Any]) -> bool:
    # Imported here: chunkmem.deepspeed_config imports chunkmem.config, which imports this module.
    from chunkmem.deepspeed_config import is_deepspeed_config

    return is_deepspeed_config(data)
