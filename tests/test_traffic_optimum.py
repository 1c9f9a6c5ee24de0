"""The independent traffic optimum of benchmarks/chunk_traffic is exact: the integer program's
answer equals a brute-force enumeration of every schedule, on hand-checked and random traces."""

from __future__ import annotations

import itertools
import random

import pytest

from benchmarks.traffic_optimum import (
    TrafficProblem,
    compulsory_bytes,
    optimal_schedule,
    schedule_cost,
)

A, B, C, G = 0, 1, 2, 3


def _problem(sizes, device, budgets, host=None, freed=None) -> TrafficProblem:
    count = len(device)
    return TrafficProblem(
        sizes=sizes,
        device=[frozenset(m) for m in device],
        host=[frozenset(m) for m in (host or [()] * count)],
        freed=[frozenset(m) for m in (freed or [()] * count)],
        budgets=budgets,
    )


def brute_force(problem: TrafficProblem) -> int | None:
    """The cheapest of all schedules, each priced by schedule_cost; None if none fits."""
    chunks = sorted(problem.sizes)
    per_moment = []
    for t in range(problem.moments):
        options = [
            frozenset(subset)
            for k in range(len(chunks) + 1)
            for subset in itertools.combinations(chunks, k)
        ]
        per_moment.append([s for s in options if problem.device[t] <= s])
    costs = (schedule_cost(problem, list(s)) for s in itertools.product(*per_moment))
    return min((c for c in costs if c is not None), default=None)


def test_two_slots_three_chunks_cost_four_moves():
    """Moments need {A, B}, {C}, {A}, {B}; the device holds two chunks of 100 bytes.

    Moment 1 holds C and at most one of A and B: C must come and go (2 moves) and one of A, B
    must leave and come back (2 moves). Keeping A at moment 1 (needed next) and bringing B back
    at moment 2 does it in 4 moves: 400 bytes. Unlimited, nothing ever moves.
    """
    problem = _problem({A: 100, B: 100, C: 100}, [{A, B}, {C}, {A}, {B}], [200] * 4)
    assert compulsory_bytes(problem) == 0
    assert brute_force(problem) == 400
    assert optimal_schedule(problem).bytes_moved == 400


def test_host_step_and_freed_gradient_cost_what_the_ledger_counts():
    """An fp32 cycle in miniature: forward needs parameter A, backward A and its gradient G,
    the host-side step needs both on the host, then G's content dies.

    A leaves for the step (1 move) and comes back for the forward (1 move); G is allocated
    fresh in backward (free) and leaves for the step (1 move); its death is free. 3 moves of
    100 bytes, whatever the budget, so the optimum equals the compulsory minimum.
    """
    problem = _problem(
        {A: 100, G: 100},
        device=[{A}, {A, G}, ()],
        host=[(), (), {A, G}],
        freed=[(), (), {G}],
        budgets=[200] * 3,
    )
    assert compulsory_bytes(problem) == 300
    assert brute_force(problem) == 300
    assert optimal_schedule(problem).bytes_moved == 300


def test_unequal_sizes_keep_the_big_chunk():
    """A (300 bytes), B and C (100 each) are all needed before and after a moment whose budget
    is 300: keeping A and evicting B and C costs 2 x 200 = 400, keeping B and C and evicting A
    costs 2 x 300 = 600."""
    problem = _problem(
        {A: 300, B: 100, C: 100},
        device=[{A, B, C}, set(), {A, B, C}],
        budgets=[500, 300, 500],
    )
    assert brute_force(problem) == 400
    assert optimal_schedule(problem).bytes_moved == 400


def test_infeasible_budget_is_refused():
    problem = _problem({A: 100, B: 100}, [{A, B}], [150])
    assert brute_force(problem) is None
    with pytest.raises(RuntimeError, match="no schedule fits"):
        optimal_schedule(problem)


def _random_problem(rng: random.Random) -> TrafficProblem:
    chunks = list(range(rng.randint(2, 4)))
    moments = rng.randint(2, 5)
    sizes = {c: 100 * rng.randint(1, 3) for c in chunks}
    device, host, freed, budgets = [], [], [], []
    for _ in range(moments):
        on_device = {c for c in chunks if rng.random() < 0.35}
        on_host = {c for c in chunks if c not in on_device and rng.random() < 0.15}
        device.append(on_device)
        host.append(on_host)
        freed.append({c for c in chunks if rng.random() < 0.1})
        needed = sum(sizes[c] for c in on_device)
        budgets.append(needed + 100 * rng.randint(0, 3))
    return _problem(sizes, device, budgets, host, freed)


@pytest.mark.parametrize("seed", range(30))
def test_solver_matches_brute_force_on_random_traces(seed):
    problem = _random_problem(random.Random(seed))
    expected = brute_force(problem)
    solved = optimal_schedule(problem)
    assert solved.bytes_moved == expected
    assert schedule_cost(problem, solved.resident) == expected
    assert solved.lp_bound <= expected + 1e-6
    assert compulsory_bytes(problem) <= expected


@pytest.mark.parametrize("seed", range(10))
def test_unlimited_budget_gives_the_compulsory_minimum(seed):
    problem = _random_problem(random.Random(100 + seed))
    unlimited = TrafficProblem(
        problem.sizes,
        problem.device,
        problem.host,
        problem.freed,
        [sum(problem.sizes.values())] * problem.moments,
    )
    assert optimal_schedule(unlimited).bytes_moved == compulsory_bytes(problem)
    assert brute_force(unlimited) == compulsory_bytes(problem)
