"""Victim ranking, the per-moment plan, and the offline traffic replay."""

from __future__ import annotations

from chunkmem.placement import plan_moment, rank_victims, simulate_traffic
from chunkmem.tracer import Moment, Phase, Trace

D = True  # needed on the device


def test_belady_evicts_the_farthest_next_use_and_lru_the_oldest() -> None:
    next_use = {1: 5.0, 2: 1.0, 3: float("inf"), 4: 3.0}
    last = {1: 40, 2: 10, 3: 30, 4: 20}
    assert rank_victims(next_use, True, next_use.__getitem__, last.__getitem__) == [3, 1, 4, 2]
    assert rank_victims(next_use, False, next_use.__getitem__, last.__getitem__) == [2, 4, 3, 1]


def test_plan_keeps_budget_and_never_evicts_what_the_moment_needs() -> None:
    sizes = {c: 10 for c in range(6)}
    order = lambda cands: sorted(cands)  # noqa: E731
    plan = plan_moment({0, 1, 2}, {3: D, 1: D}, sizes.__getitem__, 30, lambda c: True, order)
    assert plan.to_device == [3]
    assert plan.to_host == [0]  # 1 is needed, so 0 goes first
    tight = plan_moment({0, 1}, {2: D, 3: D}, sizes.__getitem__, 10, lambda c: c != 0, order)
    assert tight.to_host == [1] and tight.to_device == [2, 3]  # soft budget: needed ones admitted


def test_plan_sends_host_requirements_first() -> None:
    sizes = {c: 10 for c in range(3)}
    plan = plan_moment({0, 1}, {0: False, 2: D}, sizes.__getitem__, 20, lambda c: True, sorted)
    assert plan.to_host == [0] and plan.to_device == [2]


def cyclic_trace(chunks: int) -> Trace:
    trace = Trace()
    for c in range(chunks):
        trace.moments.append(Moment(Phase.FORWARD, str(c)))
        trace.accesses.append({c: D})
        trace.nonmodel_peak.append(0)
        trace.freed.append(set())
    return trace


def test_offline_belady_beats_lru_on_a_cyclic_scan() -> None:
    # 5 chunks cycled with room for 4: LRU misses every access, Belady only one per cycle.
    trace = cyclic_trace(5)
    sizes = {c: 100 for c in range(5)}
    budgets = [400] * 5
    belady = simulate_traffic(trace, sizes, budgets, "belady")
    lru = simulate_traffic(trace, sizes, budgets, "lru")
    assert lru.bytes_to_device == 5 * 100
    assert belady.bytes_to_device == 1 * 100
    assert belady.peak_resident_bytes <= 400


def test_freed_chunks_cost_nothing_to_bring_back() -> None:
    trace = cyclic_trace(2)
    trace.freed[1].add(1)  # chunk 1 dies after its use (like gradients after the step)
    sizes = {0: 100, 1: 100}
    result = simulate_traffic(trace, sizes, [100, 100], "belady")
    assert result.bytes_to_device == 100  # chunk 0 comes back; chunk 1 is allocated fresh
    assert result.bytes_to_host == 100
