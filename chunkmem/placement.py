"""Placement policy: which chunks to evict, how many bytes chunks may use, what to prefetch.

This module decides; :mod:`chunkmem.manager` carries the decisions out. The same victim
ranking and per-moment plan drive the online engine and :func:`simulate_traffic`, the
offline replay that benchmarks use to compute the Belady (farthest-next-use) bound on the
very trace the engine recorded.

Only parameter and gradient chunks are placed dynamically. Optimizer-state chunks have a
fixed home tier, chosen once from the first trace (see :func:`optimizer_state_device_groups`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from chunkmem.tracer import Trace, Tracer

POLICIES = ("belady", "lru")


def rank_victims(
    candidates: Iterable[int],
    use_belady: bool,
    next_use: Callable[[int], float],
    last_access: Callable[[int], int],
) -> list[int]:
    """Chunk ids, most evictable first.

    Belady: the chunk needed again farthest in the future; LRU: the least recently accessed.
    Ties break towards the higher chunk id so that runs are deterministic.
    """
    if use_belady:
        return sorted(candidates, key=lambda c: (-next_use(c), -c))
    return sorted(candidates, key=lambda c: (last_access(c), -c))


@dataclass
class MomentPlan:
    """Moves one moment needs: chunks to send to the host, then chunks to bring in."""

    to_host: list[int]
    to_device: list[int]


def plan_moment(
    resident: set[int],
    needed: dict[int, bool],
    nbytes: Callable[[int], int],
    budget: int,
    movable: Callable[[int], bool],
    rank: Callable[[Iterable[int]], list[int]],
) -> MomentPlan:
    """Bring every chunk needed on the device in, keeping resident bytes within ``budget``.

    ``needed`` maps chunk ids to whether the moment needs them on the device; chunks it needs
    off the device (an update where their states live) go there first. Each incoming chunk first evicts the best
    victims until it fits; the budget is soft (the needed chunks are always admitted), and the
    hard capacity is the ledger's to enforce.
    """
    resident = set(resident)
    to_host = [c for c, on_device in needed.items() if not on_device and c in resident]
    resident.difference_update(to_host)
    used = sum(nbytes(c) for c in resident)
    incoming = [c for c, on_device in needed.items() if on_device]
    protected = set(incoming)
    to_device = []
    for chunk in incoming:
        if chunk in resident:
            continue
        if used + nbytes(chunk) > budget:
            for victim in rank(c for c in resident if c not in protected and movable(c)):
                if used + nbytes(chunk) <= budget:
                    break
                resident.discard(victim)
                to_host.append(victim)
                used -= nbytes(victim)
        resident.add(chunk)
        to_device.append(chunk)
        used += nbytes(chunk)
    if used > budget:
        for victim in rank(c for c in resident if c not in protected and movable(c)):
            if used <= budget:
                break
            resident.discard(victim)
            to_host.append(victim)
            used -= nbytes(victim)
    return MomentPlan(to_host, to_device)


class Placement:
    """Budgets and rankings for the online engine, from the live trace."""

    def __init__(
        self,
        policy: str,
        prefetch: bool,
        nonmodel_margin: float,
        capacity: int,
        lookahead: int = 2,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"placement policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.prefetch = prefetch
        self.nonmodel_margin = nonmodel_margin
        self.capacity = capacity
        self.lookahead = lookahead

    def chunk_budget(self, tracer: Tracer, static_bytes: int, moments_ahead: int = 0) -> int:
        """Bytes the dynamically placed chunks may hold from now until ``moments_ahead`` on.

        Replaying: capacity minus static bytes minus the traced non-model peak of those
        moments (plus margin). Recording: see :meth:`recording_budget`.
        """
        if not tracer.replaying:
            return self.recording_budget(tracer, static_bytes)
        peak = tracer.traced_nonmodel_peak(tracer.index, tracer.index + 1 + moments_ahead)
        return self.capacity - static_bytes - math.ceil(peak * (1 + self.nonmodel_margin))

    def release_budget(self, tracer: Tracer, static_bytes: int) -> int:
        """Bytes chunks may hold once the current moment's chunks are released, until the
        next moment. Recording: see :meth:`recording_budget`."""
        if not tracer.replaying:
            return self.recording_budget(tracer, static_bytes)
        peak = tracer.traced_nonmodel_after_release()
        return self.capacity - static_bytes - math.ceil(peak * (1 + self.nonmodel_margin))

    def recording_budget(self, tracer: Tracer, static_bytes: int) -> int:
        """While a trace is recorded: the device less the highest non-model bytes this cycle
        has shown so far (plus margin). Activations not seen yet may outgrow it; the pressure
        valve then evicts chunks no moment is using (``Room.on_nonmodel_growth``), so the
        device overflows only if one moment's own chunks and activations exceed it.

        [Note: the first cycle looks like the steady one] A budget of zero while recording
        kept only the current moment's chunks: every other chunk went to the host and came
        back, so the first iteration (and the first of every new input shape) moved the
        model's chunks both ways and peaked on the host where the steady state used none.
        """
        seen = max(tracer.observed.nonmodel_peak, default=0)
        return max(0, self.capacity - static_bytes - math.ceil(seen * (1 + self.nonmodel_margin)))

    def lowest_budget(self, tracer: Tracer, static_bytes: int) -> int | None:
        """The smallest chunk budget of any moment of the replayed trace (None: recording)."""
        if tracer.replay is None:
            return None
        peak = tracer.replay.max_nonmodel
        return self.capacity - static_bytes - math.ceil(peak * (1 + self.nonmodel_margin))

    def rank(
        self, tracer: Tracer, last_access: Callable[[int], int]
    ) -> Callable[[Iterable[int]], list[int]]:
        use_belady = self.policy == "belady" and tracer.replaying
        next_use = tracer.next_device_use if use_belady else (lambda c: 0.0)
        return lambda candidates: rank_victims(candidates, use_belady, next_use, last_access)

    def prefetch_targets(self, tracer: Tracer) -> list[tuple[int, int]]:
        """(moments ahead, chunk id) of chunks needed on the device soon, soonest first."""
        if not self.prefetch:
            return []
        targets = []
        seen = set()
        for index, accessed in tracer.upcoming(self.lookahead):
            for chunk_id, on_device in accessed.items():
                if on_device and chunk_id not in seen:
                    seen.add(chunk_id)
                    targets.append((index - tracer.index, chunk_id))
        return targets


@dataclass(frozen=True)
class TrafficResult:
    bytes_to_device: int
    bytes_to_host: int
    peak_resident_bytes: int

    @property
    def bytes_moved(self) -> int:
        return self.bytes_to_device + self.bytes_to_host


def simulate_traffic(
    trace: Trace,
    nbytes: dict[int, int],
    budgets: Sequence[int],
    policy: str,
    resident: Iterable[int] = (),
    cycles: int = 3,
) -> TrafficResult:
    """Replay ``trace`` offline with ``policy`` and exact future knowledge; bytes of the last cycle.

    ``budgets[i]`` is the bytes chunks may use at moment ``i``. Earlier cycles warm the
    resident set up, so the result is the steady state, comparable with a measured iteration.
    """
    resident_set = set(resident)
    dead = set().union(*trace.freed) if trace.freed else set()
    last_access: dict[int, int] = {}
    tick = 0
    result = TrafficResult(0, 0, 0)
    trace.finalize()
    use_belady = policy == "belady"
    for _cycle in range(cycles):
        to_device = to_host = peak = 0
        for index, accessed in enumerate(trace.accesses):
            plan = plan_moment(
                resident_set,
                accessed,
                nbytes.__getitem__,
                budgets[index],
                lambda _chunk: True,
                _offline_ranker(trace, index, use_belady, last_access),
            )
            for chunk in plan.to_host:
                resident_set.discard(chunk)
                to_host += nbytes[chunk]
            for chunk in plan.to_device:
                resident_set.add(chunk)
                if chunk in dead:
                    dead.discard(chunk)  # allocated fresh: nothing to copy
                else:
                    to_device += nbytes[chunk]
            for chunk, on_device in accessed.items():
                if on_device:
                    tick += 1
                    last_access[chunk] = tick
            if trace.streamed:
                to_device += trace.streamed[index][0]
                to_host += trace.streamed[index][1]
            for chunk in trace.freed[index] if trace.freed else ():
                resident_set.discard(chunk)
                dead.add(chunk)
            peak = max(peak, sum(nbytes[c] for c in resident_set))
        result = TrafficResult(to_device, to_host, peak)
    return result


def _offline_ranker(
    trace: Trace, index: int, use_belady: bool, last_access: dict[int, int]
) -> Callable[[Iterable[int]], list[int]]:
    def next_use(chunk: int) -> float:
        return trace.next_device_use(chunk, index)

    def last(chunk: int) -> int:
        return last_access.get(chunk, -1)

    return lambda candidates: rank_victims(candidates, use_belady, next_use, last)


def optimizer_state_device_groups(
    capacity: int,
    peak_nonmodel: int,
    dynamic_bytes: int,
    group_bytes: Sequence[int],
    mode: str,
) -> int:
    """How many optimizer-state chunk groups (in step order) live on the device.

    auto: only when every parameter and gradient chunk fits beside the non-model peak, fill
    the remaining device bytes with whole groups; otherwise the device is needed for
    cycling parameter chunks and all optimizer states stay on the host.
    """
    if mode == "host":
        return 0
    if mode == "device":
        return len(group_bytes)
    free = capacity - peak_nonmodel - dynamic_bytes
    count = 0
    for size in group_bytes:
        if free < size:
            break
        free -= size
        count += 1
    return count


def offloaded_group_count(group_elements: Sequence[int], ratio: float) -> int:
    """How many optimizer-state groups, taken from the last in step order, hold at least
    ``ratio`` of the elements (``offload.optimizer_ratio``, rounded up to whole groups).

    The last groups are packed last and so are the first whose gradients are final in
    backward: updated on the host, they overlap the most of the remaining backward.
    """
    target = ratio * sum(group_elements)
    count, taken = 0, 0
    for size in reversed(group_elements):
        if taken >= target:
            break
        taken += size
        count += 1
    return count
