"""How long this process's recent training steps took inside the engine.

``compression: auto`` weighs the link time a method saves against the step. Timed as the
interval between consecutive steps, a step would hold whatever the training loop does between
them (data loading, an evaluation, other engines' steps in one process); a method can save
none of that, and the loop's period would shrink the share of the step it saves. The clock
runs from the first forward after a step (gradient accumulation's micro-steps included) to
the end of that step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

KEEP = 8  # the last steps kept


class CycleClock:
    """Fed by the sharding at each cycle's start and at each step's end."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now
        self._began: float | None = None
        self.durations: deque[float] = deque(maxlen=KEEP)

    def began(self) -> None:
        """A forward starts; the first since the last step starts the step's time."""
        if self._began is None:
            self._began = self._now()

    def ended(self) -> None:
        """A step ended (its parameters updated or skipped)."""
        if self._began is not None:
            self.durations.append(self._now() - self._began)
            self._began = None
