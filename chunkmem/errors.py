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


class NonFiniteError(ChunkmemError, FloatingPointError):
    """Training cannot make progress on non-finite values (fp16 gradients that overflow even at
    the minimum loss scale). A single non-finite gradient norm raises the plain
    ``FloatingPointError`` the engine documents; both are "diverged" to the ``chunkmem``
    command (exit code 5)."""


class IllegalTransitionError(ChunkmemError, RuntimeError):
    """A tensor was moved between states that the transition table forbids."""


class EngineUsageError(ChunkmemError, RuntimeError):
    """The engine's methods were called in an order or way it does not support."""


class CheckpointError(ChunkmemError):
    """A checkpoint cannot be written where asked, is incomplete, or does not fit the engine;
    names the path, key or value concerned."""


class CollectiveError(ChunkmemError, RuntimeError):
    """A collective failed or timed out; names the operation, the group and the cause.

    The group may be poisoned afterwards (see zero/comm.py, [Note: a failed collective is
    final]): the engine stops, and every later call says so.
    """

    def __init__(
        self,
        op: str,
        group: str,
        ranks: tuple[int, ...],
        elapsed_s: float,
        timeout_s: float,
        cause: str,
    ) -> None:
        self.op = op
        self.group = group
        self.ranks = ranks
        self.elapsed_s = elapsed_s
        self.timeout_s = timeout_s
        self.cause = cause
        stop = "" if cause.endswith((".", "!", "?")) else "."
        super().__init__(
            f"{op} on group {group!r} (ranks {list(ranks)}) failed after {elapsed_s:.1f} s: "
            f"{cause}{stop} A peer rank may have died or hung (the group's timeout is "
            f"{timeout_s:g} s); the group may be unusable now, so stop training rather than "
            "retry, and read the other ranks' logs for the first failure."
        )

    def __reduce__(self) -> tuple[type, tuple]:
        # Keeps the attributes when the error crosses a process boundary (a test harness, a
        # launcher collecting failures): the default pickling would pass only the message.
        args = (self.op, self.group, self.ranks, self.elapsed_s, self.timeout_s, self.cause)
        return type(self), args


class TierError(ChunkmemError):
    """A storage tier outside memory (the NVMe tier's files) failed; names the path and bytes."""


class TierSetupError(TierError, OSError):
    """A tier cannot be used as configured (an unwritable directory, too little free space);
    raised at initialize, before anything is stored there."""


class TierFullError(TierError, OSError):
    """A tier had no room for a new payload (the disk filled up, a file-size limit). Nothing
    was lost: the chunk stays where it was and the partial file is removed."""


class TierDataError(TierError, OSError):
    """A chunk's content on a tier is lost: a read returned fewer bytes than were written, a
    checksum did not match, or a write failed after the source was released. The engine stops:
    the optimizer states are no longer whole."""
