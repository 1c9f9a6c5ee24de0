"""Runtime memory tracer: moments, chunk accesses and non-model memory of a training cycle.

A cycle runs from the first forward after an optimizer step to the end of the next step (all
micro-batches of gradient accumulation included). The first cycle for an input signature
(shapes and dtypes of the batch) records a :class:`Trace`; later cycles with that signature
replay it, so placement knows each chunk's next use and each moment's non-model peak.

A cycle that departs from its trace (a branch taken, a module skipped) stops replaying at
the first differing moment, falls back to trace-free placement and records itself; if it
completes, it is kept beside the old trace, so patterns that alternate are both known.
"""

from __future__ import annotations

import bisect
import functools
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from chunkmem._enum import FastHashEnum

_TRACES_PER_SIGNATURE = 4
_SIGNATURES = 64  # least recently used signatures beyond this are forgotten


class Phase(FastHashEnum):
    FORWARD = "fwd"
    BACKWARD = "bwd"
    STEP = "step"


@dataclass(frozen=True)
class Moment:
    """A point where chunks are accessed: a module's pre-forward or pre-backward, or a step."""

    phase: Phase
    label: str

    @functools.cached_property
    def name(self) -> str:
        return f"{self.phase.value}:{self.label}"

    def __str__(self) -> str:
        return self.name


@dataclass
class Trace:
    """What one cycle did: moments in order, chunks each needed and where, non-model peaks."""

    moments: list[Moment] = field(default_factory=list)
    # chunk id -> whether the moment needed it on the compute device (False: where it lives)
    accesses: list[dict[int, bool]] = field(default_factory=list)
    freed: list[set[int]] = field(default_factory=list)  # chunks whose content died here
    # Bytes streamed at a moment without moving a chunk (into the device, out of it).
    streamed: list[tuple[int, int]] = field(default_factory=list)
    nonmodel_peak: list[int] = field(default_factory=list)  # until the next moment
    # The part of that peak reached after the moment's chunks were released (e.g. the loss
    # computed after the last layer's forward): chunks in use then may not stay for it.
    nonmodel_after_release: list[int] = field(default_factory=list)
    _device_uses: dict[int, list[int]] = field(default_factory=dict)
    max_nonmodel: int = 0

    def __len__(self) -> int:
        return len(self.moments)

    def finalize(self) -> None:
        """Index every chunk's device uses for fast next-use queries."""
        uses: dict[int, list[int]] = {}
        for index, accessed in enumerate(self.accesses):
            for chunk_id, on_device in accessed.items():
                if on_device:
                    uses.setdefault(chunk_id, []).append(index)
        self._device_uses = uses
        self.max_nonmodel = max(self.nonmodel_peak, default=0)

    def next_device_use(self, chunk_id: int, now: int) -> float:
        """Moments from ``now`` until the chunk is needed on the device (0: this moment).

        A use at the current moment counts: the chunks of one moment are accessed in several
        calls (parameters, then gradients), and the later ones must not be evicted by the
        earlier. The trace repeats, so a chunk not needed again this cycle is next needed at
        its first use in the next one; one the trace never needs on the device is infinitely
        far.
        """
        uses = self._device_uses.get(chunk_id)
        if not uses:
            return float("inf")
        position = bisect.bisect_left(uses, now)
        if position < len(uses):
            return uses[position] - now
        return uses[0] + len(self.moments) - now

    def peak_nonmodel(self, start: int, stop: int) -> int:
        """Highest non-model peak over moments ``start..stop-1``, wrapping into the next cycle."""
        count = len(self.nonmodel_peak)
        if not count:
            return 0
        return max(
            self.nonmodel_peak[i % count] for i in range(max(0, start), max(start + 1, stop))
        )


class Tracer:
    """Records and replays traces per input signature."""

    def __init__(self) -> None:
        self._traces: OrderedDict[Hashable, list[Trace]] = OrderedDict()
        self.signature: Hashable | None = None
        self.replay: Trace | None = None
        self.observed = Trace()
        self.index = -1
        self.cycles_recorded = 0
        self.divergences = 0
        self._released = False

    @property
    def replaying(self) -> bool:
        return self.replay is not None

    @property
    def in_cycle(self) -> bool:
        return self.signature is not None

    def begin_cycle(self, signature: Hashable) -> None:
        self.signature = signature
        known = self._traces.get(signature)
        if known:
            self._traces.move_to_end(signature)
        self.replay = known[-1] if known else None
        self.observed = Trace()
        self.index = -1

    def on_moment(self, moment: Moment, nonmodel_now: int) -> int:
        """Advance to ``moment``; returns its index in the cycle."""
        self.index += 1
        self.observed.moments.append(moment)
        self.observed.accesses.append({})
        self.observed.freed.append(set())
        self.observed.streamed.append((0, 0))
        self.observed.nonmodel_peak.append(nonmodel_now)
        self.observed.nonmodel_after_release.append(0)
        self._released = False
        if self.replay is not None and not self._matches(self.replay):
            self.replay = self._find_matching()
            if self.replay is None:
                self.divergences += 1
        return self.index

    def on_access(self, chunk_id: int, on_device: bool) -> None:
        if self.index >= 0:
            accessed = self.observed.accesses[self.index]
            # The device wins: a chunk needed on the device at this moment must be there.
            if not accessed.get(chunk_id, False):
                accessed[chunk_id] = on_device

    def on_stream(self, nbytes: int, to_device: bool) -> None:
        if self.index >= 0:
            into_device, out_of_device = self.observed.streamed[self.index]
            if to_device:
                into_device += nbytes
            else:
                out_of_device += nbytes
            self.observed.streamed[self.index] = (into_device, out_of_device)

    def on_free(self, chunk_id: int) -> None:
        if self.index >= 0:
            self.observed.freed[self.index].add(chunk_id)

    def on_nonmodel(self, nbytes: int) -> None:
        if self.index < 0:
            return
        observed = self.observed
        if nbytes > observed.nonmodel_peak[self.index]:
            observed.nonmodel_peak[self.index] = nbytes
        if self._released and nbytes > observed.nonmodel_after_release[self.index]:
            observed.nonmodel_after_release[self.index] = nbytes

    def on_release(self) -> None:
        """The current moment's chunks were released; later growth may not keep them."""
        self._released = True

    def end_cycle(self) -> None:
        """Keep what this cycle taught: a new trace, or higher peaks for the replayed one."""
        if self.signature is None:
            return
        observed = self.observed
        replayed = self.replay
        if replayed is not None and len(replayed) == len(observed):
            replayed.nonmodel_peak = _higher(replayed.nonmodel_peak, observed.nonmodel_peak)
            replayed.nonmodel_after_release = _higher(
                replayed.nonmodel_after_release, observed.nonmodel_after_release
            )
            replayed.accesses = observed.accesses
            replayed.freed = observed.freed
            replayed.streamed = observed.streamed
            replayed.finalize()
        elif len(observed):
            observed.finalize()
            known = self._traces.setdefault(self.signature, [])
            known.append(observed)
            del known[:-_TRACES_PER_SIGNATURE]
            while len(self._traces) > _SIGNATURES:
                self._traces.popitem(last=False)
            self.cycles_recorded += 1
        self.signature = None
        self.replay = None
        self.index = -1

    def abandon_cycle(self) -> None:
        """Forget a cycle that ended in an exception; it teaches nothing reliable."""
        self.signature = None
        self.replay = None
        self.index = -1

    def _matches(self, trace: Trace) -> bool:
        return self.index < len(trace) and trace.moments[self.index] == self.observed.moments[-1]

    def _find_matching(self) -> Trace | None:
        for trace in reversed(self._traces.get(self.signature, [])):
            if len(trace) > self.index and trace.moments[: self.index + 1] == self.observed.moments:
                return trace
        return None

    # What placement asks.
    def next_device_use(self, chunk_id: int) -> float:
        assert self.replay is not None
        return self.replay.next_device_use(chunk_id, self.index)

    def current_accesses(self) -> dict[int, bool]:
        """What the replayed trace says the current moment accesses."""
        if self.replay is None or not 0 <= self.index < len(self.replay):
            return {}
        return self.replay.accesses[self.index]

    def needed_again_this_phase(self, chunk_id: int) -> bool:
        """Whether the replayed trace uses the chunk again before the phase changes."""
        assert self.replay is not None
        distance = self.replay.next_device_use(chunk_id, self.index + 1)
        if distance == float("inf"):
            return False
        phase = self.replay.moments[self.index].phase
        stop = self.index + 1 + int(distance)
        count = len(self.replay)
        return all(
            self.replay.moments[i % count].phase is phase for i in range(self.index + 1, stop + 1)
        )

    def upcoming(self, lookahead: int) -> list[tuple[int, dict[int, bool]]]:
        """The next ``lookahead`` moments' accesses, wrapping into the next cycle."""
        if self.replay is None or not len(self.replay):
            return []
        count = len(self.replay)
        stop = self.index + 1 + min(lookahead, count - 1)
        return [(i, self.replay.accesses[i % count]) for i in range(self.index + 1, stop)]

    def traced_nonmodel_peak(self, start: int, stop: int) -> int:
        assert self.replay is not None
        return self.replay.peak_nonmodel(start, stop)

    def traced_nonmodel_after_release(self) -> int:
        """The traced non-model peak after the current moment's chunks are released."""
        assert self.replay is not None
        return self.replay.nonmodel_after_release[self.index]

    def traces_for(self, signature: Hashable) -> list[Trace]:
        return list(self._traces.get(signature, []))


def _higher(a: list[int], b: list[int]) -> list[int]:
    return [max(x, y) for x, y in zip(a, b, strict=True)]
