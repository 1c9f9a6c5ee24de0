"""A staged reduction's failure between its collectives, kept for its ``wait``.

qgZ and PowerSGD reduce in two collectives: ``advance`` (or a poll) waits for the first,
computes on what arrived and issues the second. If that raises, the error goes to whoever
advanced, and the work is left without its second collective. Its ``wait`` (a cancel waits
too) must then raise that error again, named, instead of waiting on a collective that does not
exist (an ``AttributeError`` that hides the cause) or writing a shard from half-computed
buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class StageFailed(RuntimeError):
    """A staged reduction's ``wait`` after one of its stages raised."""


class StageGuard:
    """Records the first failure of ``what``'s stages; :meth:`check` raises it again."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failed_stage: str | None = None
        self.error: BaseException | None = None

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Run stage ``name``; if it raises, remember that (the error propagates)."""
        try:
            yield
        except BaseException as error:
            if self.error is None:
                self.failed_stage, self.error = name, error
            raise

    def check(self) -> None:
        """Raise :class:`StageFailed` (caused by the first failure) if a stage failed."""
        if self.error is not None:
            raise StageFailed(
                f"{self.what}: its stage '{self.failed_stage}' raised earlier "
                f"({type(self.error).__name__}: {self.error}), so the reduction cannot finish; "
                "the step that launched it must be abandoned (the engine cancels it)"
            ) from self.error
