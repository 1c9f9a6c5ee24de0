"""Exception types: each names what was wrong and what to change."""

from __future__ import annotations


class ChunkmemError(Exception):
    """Base class of every error chunkmem raises on purpose."""


class ConfigError(ChunkmemError, ValueError):
    """A config key, type or value is invalid."""


class CapacityError(ChunkmemError):
    """The memory budget cannot hold what training needs; raised before any update."""


class OutOfMemoryError(ChunkmemError, MemoryError):
    """An accounted allocation would exceed a tier's capacity and nothing could be evicted."""

    def __init__(self, tier: str, needed_bytes: int, available_bytes: int, detail: str) -> None:
        self.tier = tier
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        super().__init__(
            f"{tier} memory exhausted: {needed_bytes:,} bytes needed, {available_bytes:,} available. "
            f"{detail}"
        )


class IllegalTransitionError(ChunkmemError, RuntimeError):
    """A tensor was moved between states that the transition table forbids."""


class EngineUsageError(ChunkmemError, RuntimeError):
    """The engine's methods were called in an order or way it does not support."""
