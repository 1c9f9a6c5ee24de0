"""The fewest bytes any placement can move for a chunk trace: an exact integer program.

This module is the independent check of the engine's placement (`chunkmem/placement.py`): it
imports nothing of chunkmem and shares no code with it. It states the placement problem as
data (`TrafficProblem`), prices any schedule (`schedule_cost`), and finds the cheapest one
with an integer program solved by HiGHS (`scipy.optimize.milp`).

[Note: the model] A training cycle is a sequence of moments. At moment t some chunks must be
on the device (`device[t]`), some on the host (`host[t]`, e.g. an fp32 parameter chunk for a
host-side optimizer step), and the chunks on the device may hold at most `budgets[t]` bytes
(the capacity less what is not placed: optimizer states homed on the device, workspaces, the
moment's non-model peak). Chunks move only between moments. A schedule says which chunks are
on the device during each moment; it repeats every cycle (the steady state), so the cycle's
last moment is followed by its first.

Cost = bytes moved in + bytes moved out, per cycle, counted as the engine's ledger counts them:
a chunk has one copy, so every move of a live chunk, in or out, copies all its bytes (there
is no clean eviction). A chunk whose content dies at the end of moment t (`freed[t]`, e.g. a
gradient after the step) leaves at no cost and is dead until its next access, where it is
allocated fresh, also at no cost (any crossing right after the free copies nothing). Bytes streamed without moving a chunk (the step's gradients
and values) are the same for every schedule and are not part of this problem.

`compulsory_bytes` is the cost with an unlimited budget, by a closed form that does not use
the solver: only moves that some access forces (device, then host, then device again) remain.

The integer program has one binary per (chunk, moment) that no access fixes, and a continuous
move-in and move-out per (chunk, moment), priced in bytes; `optimal_schedule` solves it with a
relative gap of 0, so the result is exact, then re-prices the solver's schedule with
`schedule_cost` (integer arithmetic) and checks that both agree. Its linear relaxation
(`lp_bound`) is a lower bound on the average cost per cycle of any schedule that repeats
every k cycles (the average over its k cycles is a feasible fractional one-cycle schedule, and
the cost is convex), so where the two are equal no multi-cycle schedule does better.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array


@dataclass(frozen=True)
class TrafficProblem:
    """One cycle of chunk accesses and the device bytes chunks may hold at each moment."""

    sizes: dict[int, int]  # chunk -> bytes
    device: Sequence[frozenset[int]]  # per moment: chunks that must be on the device
    host: Sequence[frozenset[int]]  # per moment: chunks that must be on the host
    freed: Sequence[frozenset[int]]  # per moment: chunks whose content dies at its end
    budgets: Sequence[int]  # per moment: bytes the chunks on the device may hold

    def __post_init__(self) -> None:
        lengths = {len(self.device), len(self.host), len(self.freed), len(self.budgets)}
        if len(lengths) != 1:
            raise ValueError(f"device, host, freed and budgets differ in length: {lengths}")
        for t, (on_device, on_host) in enumerate(zip(self.device, self.host, strict=True)):
            if on_device & on_host:
                raise ValueError(f"moment {t} needs {sorted(on_device & on_host)} on both tiers")
            unknown = (on_device | on_host | self.freed[t]) - self.sizes.keys()
            if unknown:
                raise ValueError(f"moment {t} names chunks without a size: {sorted(unknown)}")

    @property
    def moments(self) -> int:
        return len(self.budgets)

    def dead(self) -> list[frozenset[int]]:
        """Per moment, the chunks without content: freed earlier, not accessed since."""
        count = self.moments
        dead: list[set[int]] = [set() for _ in range(count)]
        for f in range(count):
            for chunk in self.freed[f]:
                for step in range(1, count + 1):
                    t = (f + step) % count
                    if chunk in self.device[t] or chunk in self.host[t]:
                        break
                    dead[t].add(chunk)
        return [frozenset(d) for d in dead]

    def free_transitions(self) -> list[frozenset[int]]:
        """Per moment t, the chunks that cross between t - 1 and t without copying anything:
        freed at t - 1 or dead there (their content is gone, so arriving is a fresh
        allocation and leaving drops nothing)."""
        dead = self.dead()
        return [self.freed[t - 1] | dead[t - 1] for t in range(self.moments)]

    def forced(self) -> list[dict[int, int]]:
        """Per moment, chunk -> 1 (must be on the device) or 0 (must not be)."""
        dead = self.dead()
        return [
            {
                **{c: 0 for c in dead[t] | self.host[t]},
                **{c: 1 for c in self.device[t]},
            }
            for t in range(self.moments)
        ]


def schedule_cost(problem: TrafficProblem, resident: Sequence[frozenset[int]]) -> int | None:
    """Bytes moved per cycle by the schedule `resident` (chunks on the device during each
    moment, repeating every cycle); None if it breaks an access or a budget."""
    count = problem.moments
    if len(resident) != count:
        raise ValueError(f"the schedule has {len(resident)} moments, the problem {count}")
    dead = problem.dead()
    for t in range(count):
        on = resident[t]
        if not problem.device[t] <= on or on & (problem.host[t] | dead[t]):
            return None
        if sum(problem.sizes[c] for c in on) > problem.budgets[t]:
            return None
    free = problem.free_transitions()
    return sum(
        problem.sizes[c]
        for t in range(count)
        for c in resident[t] ^ resident[t - 1]
        if c not in free[t]
    )


def compulsory_bytes(problem: TrafficProblem) -> int:
    """Bytes moved per cycle with an unlimited budget: each live chunk stays where its last
    access left it, so it moves only when an access needs it on the other tier."""
    total = 0
    count = problem.moments
    for chunk, size in problem.sizes.items():
        where = [
            "device" if chunk in problem.device[t] else "host" if chunk in problem.host[t] else None
            for t in range(count)
        ]
        accessed = [t for t in range(count) if where[t] is not None]
        freed_at = {t for t in range(count) if chunk in problem.freed[t]}
        for i, t in enumerate(accessed):
            previous = accessed[i - 1]  # cyclic: the first access follows the last
            # Freed since the previous access (inclusive of its own moment)? Then allocated fresh.
            span = [(previous + k) % count for k in range((t - previous) % count or count)]
            if any(m in freed_at for m in span):
                continue
            if where[t] != where[previous]:
                total += size
    return total


@dataclass(frozen=True)
class OptimalSchedule:
    bytes_moved: int
    resident: list[frozenset[int]]
    lp_bound: float  # the linear relaxation's optimum, bytes
    variables: int  # binaries left free by the accesses


def optimal_schedule(problem: TrafficProblem, time_limit_s: float = 300.0) -> OptimalSchedule:
    """The cheapest schedule of `problem`, proven optimal (relative MIP gap 0)."""
    count = problem.moments
    chunks = sorted(problem.sizes)
    forced = problem.forced()
    free = problem.free_transitions()
    # Sizes in units of their gcd keep the coefficients small and the budgets exact integers.
    unit = reduce(math.gcd, problem.sizes.values(), 0) or 1
    size = {c: problem.sizes[c] // unit for c in chunks}

    # Variables: r[c, t] (on the device during t), then move-in and move-out at each t.
    index = {(c, t): i for i, (c, t) in enumerate((c, t) for c in chunks for t in range(count))}
    n_r = len(index)
    move_in = {key: n_r + i for key, i in index.items()}
    move_out = {key: 2 * n_r + i for key, i in index.items()}
    lower = np.zeros(3 * n_r)
    upper = np.ones(3 * n_r)
    for (c, t), i in index.items():
        if c in forced[t]:
            lower[i] = upper[i] = forced[t][c]
    cost = np.zeros(3 * n_r)
    for c, t in index:
        cost[move_in[c, t]] = cost[move_out[c, t]] = 0 if c in free[t] else size[c]

    rows, cols, vals, lo, hi = [], [], [], [], []

    def constraint(terms: list[tuple[int, float]], low: float, high: float) -> None:
        row = len(lo)
        for col, val in terms:
            rows.append(row)
            cols.append(col)
            vals.append(val)
        lo.append(low)
        hi.append(high)

    for c, t in index:
        now, before = index[c, t], index[c, (t - 1) % count]
        constraint([(move_in[c, t], 1), (now, -1), (before, 1)], 0, np.inf)
        constraint([(move_out[c, t], 1), (before, -1), (now, 1)], 0, np.inf)
    for t in range(count):
        constraint([(index[c, t], size[c]) for c in chunks], -np.inf, problem.budgets[t] // unit)
    matrix = coo_array((vals, (rows, cols)), shape=(len(lo), 3 * n_r)).tocsr()
    constraints = LinearConstraint(matrix, lo, hi)
    integrality = np.zeros(3 * n_r)
    integrality[:n_r] = 1

    bounds = Bounds(lower, upper)
    relaxed = milp(cost, constraints=constraints, bounds=bounds)
    if relaxed.status != 0:
        raise RuntimeError(
            f"no schedule fits the budgets (LP status {relaxed.status}: {relaxed.message})"
        )
    result = milp(
        cost,
        constraints=constraints,
        bounds=bounds,
        integrality=integrality,
        options={"mip_rel_gap": 0.0, "time_limit": time_limit_s},
    )
    if result.status != 0:
        raise RuntimeError(f"the integer program was not solved to optimality: {result.message}")
    x = result.x
    resident = [frozenset(c for c in chunks if x[index[c, t]] > 0.5) for t in range(count)]
    priced = schedule_cost(problem, resident)
    if priced is None or priced != round(result.fun) * unit:
        raise RuntimeError(
            f"the solver's schedule prices at {priced} bytes but its objective is "
            f"{result.fun * unit}: numerical trouble"
        )
    return OptimalSchedule(
        bytes_moved=priced,
        resident=resident,
        lp_bound=relaxed.fun * unit,
        variables=int(np.sum(lower[:n_r] != upper[:n_r])),
    )
