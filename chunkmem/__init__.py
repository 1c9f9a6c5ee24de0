"""chunkmem: chunk-based memory management and ZeRO sharding for PyTorch training."""

from chunkmem.api import initialize
from chunkmem.config import Config
from chunkmem.engine import Engine
from chunkmem.errors import (
    CapacityError,
    ChunkmemError,
    ConfigError,
    EngineUsageError,
    IllegalTransitionError,
    OutOfMemoryError,
)

__all__ = [
    "CapacityError",
    "ChunkmemError",
    "Config",
    "ConfigError",
    "Engine",
    "EngineUsageError",
    "IllegalTransitionError",
    "OutOfMemoryError",
    "initialize",
]
