"""chunkmem: chunk-based memory management and ZeRO sharding for PyTorch training.

The public names below load on first use, so importing a core module (``chunkmem.errors``,
``chunkmem.chunk``) or the layers that sit on it (``zero.comm``) does not drag in the engine
and everything above it: imports point down the layer stack (docs/architecture.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "initialize": "chunkmem.api",
    "consolidate": "chunkmem.checkpoint",
    "Config": "chunkmem.config",
    "Engine": "chunkmem.engine",
    "CapacityError": "chunkmem.errors",
    "CheckpointError": "chunkmem.errors",
    "ChunkmemError": "chunkmem.errors",
    "ConfigError": "chunkmem.errors",
    "EngineUsageError": "chunkmem.errors",
    "IllegalTransitionError": "chunkmem.errors",
    "OutOfMemoryError": "chunkmem.errors",
}

__all__ = [
    "CapacityError",
    "CheckpointError",
    "ChunkmemError",
    "Config",
    "ConfigError",
    "Engine",
    "EngineUsageError",
    "IllegalTransitionError",
    "OutOfMemoryError",
    "consolidate",
    "initialize",
]

if TYPE_CHECKING:
    from chunkmem.api import initialize
    from chunkmem.checkpoint import consolidate
    from chunkmem.config import Config
    from chunkmem.engine import Engine
    from chunkmem.errors import (
        CapacityError,
        CheckpointError,
        ChunkmemError,
        ConfigError,
        EngineUsageError,
        IllegalTransitionError,
        OutOfMemoryError,
    )


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'chunkmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
