"""Bytes moved between device and host per iteration: the engine's placement against the
fewest bytes any placement could move on the same trace.

    python -m benchmarks.chunk_traffic [--quick] [--json PATH]

A GPT trains on the simulated device at device budgets from the smallest that trains up to
70% of its model-state bytes, with our policy (Belady on the recorded trace) and with LRU.
Every number is an exact byte count from the ledger. For each run, the engine's own recorded
trace (the steady-state cycle: which chunks each moment needs on which tier, which die, the
non-model peak of each moment) becomes a `benchmarks.traffic_optimum.TrafficProblem`, and
three bounds are computed beside the measured bytes:

- (a) compulsory: the same trace with an unlimited budget (a closed form: only the moves an
  access forces, e.g. fp32 parameters and gradients going to a host-side optimizer step);
- (b) optimal: an integer program over every schedule of the trace's chunks under the same
  per-moment budgets, solved exactly with HiGHS; no code shared with chunkmem/placement.py;
  checked to lie between (a) and the engine, and to equal (a) with an unlimited budget;
- (c) the engine's own replay (`chunkmem.placement.simulate_traffic`, Belady and LRU) on the
  trace and budgets: a consistency check that the engine does what its planner says.

Bytes are split into chunk moves (what placement decides) and step streaming (gradients down
and updated values up around a host-side optimizer step, the same for every placement); the
ratios compare chunk moves. docs/benchmarks.md states the model's assumptions.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence

import torch

import chunkmem
from benchmarks._common import parse_args, print_table, write_results
from benchmarks.traffic_optimum import TrafficProblem, compulsory_bytes, optimal_schedule
from chunkmem.errors import CapacityError, OutOfMemoryError
from chunkmem.ledger import WORKSPACE
from chunkmem.models.gpt import GPT, GPTConfig
from chunkmem.placement import simulate_traffic

STATE_BYTES = {"fp32": 16, "bf16": 14}  # model-state bytes per parameter
MAX_FRACTION = 0.7
GOAL_RATIO_VS_OPTIMAL = 1.10


class Run:
    """One engine run at one budget and what its ledger and trace say."""

    def __init__(
        self, model: GPT, precision: str, fraction: float, policy: str, batches: list
    ) -> None:
        self.capacity = int(model.config.num_parameters() * STATE_BYTES[precision] * fraction)
        engine = chunkmem.initialize(
            copy.deepcopy(model),
            config={
                "precision": precision,
                "device": {"type": "simulated", "capacity": self.capacity},
                "placement": {"policy": policy},
                # The budgets are read from the allocation events of the last iteration:
                # keep them all (five iterations of a small model).
                "report": {"max_move_events": 1_000_000},
            },
        )
        for x, y in batches:
            engine.backward(engine(x, y))
            engine.step()
        self.engine = engine
        self.iteration = len(batches) - 1
        self.model_state_bytes = sum(engine.model_state_bytes().values())
        self.trace = engine.tracer.traces_for(next(iter(engine.tracer._traces)))[-1]
        self.streamed = sum(down + up for down, up in self.trace.streamed)
        self.total_bytes = engine.ledger.bytes_moved(self.iteration)
        # Every steady-state iteration moves the same bytes (the trace repeats exactly).
        self.steady = [engine.ledger.bytes_moved(i) for i in range(2, len(batches))]

    @property
    def chunk_move_bytes(self) -> int:
        return self.total_bytes - self.streamed

    def budgets(self) -> tuple[list[int], list[int]]:
        """Per moment of the trace: the bytes chunks may hold while the moment's chunks are in
        use, and after they are released.

        Both are the capacity less the optimizer states homed on the device and the moment's
        peak of workspaces, less a non-model amount: in use, the moment's whole traced peak
        (the trace does not say how much of it comes before the release; the engine's
        planner assumes the same, `Placement.chunk_budget`); after the release, the traced
        peak after it (`Placement.release_budget`).
        """
        engine, trace = self.engine, self.trace
        static = engine.residency.static_device_bytes()  # no workspace between steps
        workspace, _ = _per_moment(engine.ledger, self.iteration, len(trace))
        room = [self.capacity - static - w for w in workspace]
        in_use = [r - peak for r, peak in zip(room, trace.nonmodel_peak, strict=True)]
        after = [r - peak for r, peak in zip(room, trace.nonmodel_after_release, strict=True)]
        return in_use, after

    def problem(self) -> tuple[TrafficProblem, dict]:
        """The trace as a placement problem. Each moment of the trace is two moments here:
        its chunks in use (the accesses), then released (the non-model bytes that follow the
        release, e.g. the loss after the last layer, and the chunks that die)."""
        trace, chunks = self.trace, self.engine.residency.chunks
        in_use, after = self.budgets()
        # An access off the device (False) needs the chunk at its home, the host: fp32
        # parameters and gradients updated there.
        device = [frozenset(c for c, on in a.items() if on) for a in trace.accesses]
        host = [frozenset(c for c, on in a.items() if not on) for a in trace.accesses]
        freed = [frozenset(f) for f in trace.freed]
        sizes = {c: chunks[c].nbytes for c in set().union(*device, *host, *freed)}
        none: frozenset[int] = frozenset()
        budgets, raised = [], 0
        for t in range(len(trace)):
            needed = sum(sizes[c] for c in device[t])
            # Where the moment's chunks alone exceed it (the peak comes after the release, as
            # the loss after the last layer), the engine admits them and evicts after the
            # release; the optimum gets as much.
            if needed > in_use[t]:
                raised += 1
            budgets += [max(in_use[t], needed), max(after[t], 0)]
        problem = TrafficProblem(
            sizes,
            device=[m for t in range(len(trace)) for m in (device[t], none)],
            host=[m for t in range(len(trace)) for m in (host[t], none)],
            freed=[m for t in range(len(trace)) for m in (none, freed[t])],
            budgets=budgets,
        )
        info = {
            "moments": len(trace),
            "chunks": len(sizes),
            "chunk_bytes": sorted(set(sizes.values())),
            "static_device_bytes": self.engine.residency.static_device_bytes(),
            "budgets_raised_to_the_moments_chunks": raised,
        }
        return problem, info

    def lower_bound_bytes(self) -> tuple[int, str]:
        """Device bytes no placement of this run's chunks can do with: at some moment, its
        chunks beside the non-model bytes at the moment's start (they meet at least those),
        or its non-model peak alone."""
        trace, chunks = self.trace, self.engine.residency.chunks
        _, start = _per_moment(self.engine.ledger, self.iteration, len(trace))
        worst, where = 0, ""
        for t, accessed in enumerate(trace.accesses):
            chunk_bytes = sum(chunks[c].nbytes for c, on in accessed.items() if on)
            need = max(chunk_bytes + start[t], trace.nonmodel_peak[t])
            if need > worst:
                worst, where = need, trace.moments[t].name
        return worst, where

    def replay(self, policy: str) -> int:
        """(c): the engine's planner on its own trace and its budgets; chunk moves. (Its
        replay knows no release: it keeps each moment's whole-peak budget.)"""
        chunks = self.engine.residency.chunks
        sizes = {c.id: c.nbytes for c in chunks.values()}
        in_use, _ = self.budgets()
        result = simulate_traffic(self.trace, sizes, in_use, policy)
        return result.bytes_moved - self.streamed


def _per_moment(ledger, iteration: int, moments: int) -> tuple[list[int], list[int]]:
    """Per moment of `iteration`: the most device workspace bytes held at once (ledger events
    between the moment's sample and the next), and the non-model bytes at its start."""
    if ledger.allocations_dropped:
        raise RuntimeError("the ledger dropped allocation events; raise max_move_events")
    samples = [s for s in ledger.moment_samples if s.iteration == iteration]
    if len(samples) != moments:
        raise RuntimeError(
            f"{len(samples)} moment samples in iteration {iteration}, trace {moments}"
        )
    bounds = [s.allocations_before for s in samples] + [len(ledger.allocations)]

    def change(event) -> int:
        if event.tier != "device" or event.kind != WORKSPACE:
            return 0
        return event.nbytes if event.action == "alloc" else -event.nbytes

    level = sum(change(e) for e in ledger.allocations[: bounds[0]])
    peaks = []
    for t in range(moments):
        peak = level
        for event in ledger.allocations[bounds[t] : bounds[t + 1]]:
            level += change(event)
            peak = max(peak, level)
        peaks.append(peak)
    return peaks, [s.nonmodel for s in samples]


def try_run(model: GPT, precision: str, fraction: float, policy: str, batches: list) -> Run | str:
    """The run, or the error that stopped it (the budget is too small to train)."""
    try:
        return Run(model, precision, fraction, policy, batches)
    except (CapacityError, OutOfMemoryError) as e:
        return f"{type(e).__name__}: {e}"


def min_trainable(
    model: GPT, precision: str, grid: Sequence[float], batches: list
) -> tuple[dict, dict[float, Run | str]]:
    """The smallest fraction of the grid that trains, the bound below it, and the runs of the
    scan. Budgets above it may still fail (the sweep records those): trainability is not
    monotonic in the budget, because the chunk size follows the capacity."""
    runs: dict[float, Run | str] = {}
    for f in grid:  # ascending: the first that trains is the smallest, monotonic or not
        runs[f] = try_run(model, precision, f, "belady", batches)
        if isinstance(runs[f], Run):
            break
    else:
        raise RuntimeError(f"{precision}: nothing on the grid {grid} trains")
    smallest, run = f, runs[f]
    bound, where = run.lower_bound_bytes()
    below = [f for f in runs if f < smallest]
    return {
        "fraction": smallest,
        "grid": f"{grid[0]} to {grid[-1]} in steps of {round(grid[1] - grid[0], 4)}",
        "next_smaller_fails_with": runs[below[-1]] if below else None,
        # What no placement can go below with this run's chunks: one moment's chunks and
        # the non-model (activation) bytes they meet must fit at once.
        "lower_bound_fraction": bound / run.model_state_bytes,
        "lower_bound_moment": where,
        "lower_bound_bytes": bound,
        "capacity": run.capacity,
        "model_state_bytes": run.model_state_bytes,
    }, runs


def ratio(a: int, b: int) -> float | None:
    """a / b; 1.0 for 0 / 0, None (no finite ratio) for a / 0."""
    if b == 0:
        return 1.0 if a == 0 else None
    return a / b


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("chunk_traffic", __doc__.splitlines()[0], argv)
    # Only byte counts are measured, and they do not depend on threads. One thread keeps a
    # shared machine's load from stalling every parallel region (tens of times slower).
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = 2 if args.quick else 8
    config = GPTConfig(
        vocab_size=256, block_size=64, n_layer=layers, n_head=4, n_embd=128, checkpoint=True
    )
    model = GPT(config)
    data = torch.randint(0, 256, (5, 2, 65), generator=torch.Generator().manual_seed(0))
    batches = [(row[:, :-1].contiguous(), row[:, 1:].contiguous()) for row in data]
    step = 0.02 if args.quick else 0.01
    grid = [round(step * k, 2) for k in range(1, int(MAX_FRACTION / step) + 1)]
    # Just above the smallest budget the policy decides most; from 30% on little moves.
    above = (0.02, 0.05) if args.quick else (0.01, 0.02, 0.03, 0.05, 0.08)
    fixed = (0.3, 0.5, 0.7) if args.quick else (0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
    details: dict = {
        "model": config.__dict__,
        "parameters": config.num_parameters(),
        "iterations": len(batches),
        "min_trainable": {},
        "runs": {},
    }
    rows, worst_vs_optimal, peak_over_capacity = [], 0.0, 0.0
    for precision in ("fp32", "bf16"):
        smallest, scanned = min_trainable(model, precision, grid, batches)
        details["min_trainable"][precision] = smallest
        low = smallest["fraction"]
        sweep = sorted({low, *(round(low + d, 2) for d in above), *(f for f in fixed if f > low)})
        for fraction in sweep:
            key = f"{precision}@{round(fraction * 100)}%"
            ours = scanned.get(fraction) or try_run(model, precision, fraction, "belady", batches)
            lru = try_run(model, precision, fraction, "lru", batches)
            if isinstance(ours, str) or isinstance(lru, str):
                details["runs"][key] = {
                    "fraction": fraction,
                    "trains": False,
                    "error": ours if isinstance(ours, str) else f"LRU: {lru}",
                }
                rows.append([key, "does not train", *[""] * 8])
                continue
            problem, info = ours.problem()
            optimum = optimal_schedule(problem)
            compulsory = compulsory_bytes(problem)
            unlimited = TrafficProblem(
                problem.sizes,
                problem.device,
                problem.host,
                problem.freed,
                [sum(problem.sizes.values())] * problem.moments,
            )
            checks = {
                "compulsory_le_optimal": compulsory <= optimum.bytes_moved,
                "optimal_le_engine": optimum.bytes_moved <= ours.chunk_move_bytes,
                "optimal_at_unlimited_budget_eq_compulsory": (
                    optimal_schedule(unlimited).bytes_moved == compulsory
                ),
                "steady_iterations_equal": len(set(ours.steady)) == 1,
            }
            own_replay = ours.replay("belady")
            vs_optimal = ratio(ours.chunk_move_bytes, optimum.bytes_moved)
            worst_vs_optimal = max(worst_vs_optimal, vs_optimal or float("inf"))
            peak_over_capacity = max(
                peak_over_capacity,
                ours.engine.ledger.device.peak / ours.capacity,
                lru.engine.ledger.device.peak / lru.capacity,
            )
            details["runs"][key] = {
                "fraction": fraction,
                "trains": True,
                "capacity": ours.capacity,
                "model_state_bytes": ours.model_state_bytes,
                "problem": info,
                "step_streaming_bytes": ours.streamed,
                "engine": {
                    "chunk_move_bytes": ours.chunk_move_bytes,
                    "total_bytes": ours.total_bytes,
                    "steady_iterations_total_bytes": ours.steady,
                },
                "lru": {"chunk_move_bytes": lru.total_bytes - lru.streamed},
                "compulsory_bytes": compulsory,
                "optimal_bytes": optimum.bytes_moved,
                # Below the optimum only where the linear relaxation is fractional; no schedule
                # repeating over several cycles can average less.
                "optimal_lp_bound_bytes": optimum.lp_bound,
                "bytes_moved_ratio_vs_lp_bound": ratio(
                    ours.chunk_move_bytes, round(optimum.lp_bound)
                ),
                "optimal_free_binaries": optimum.variables,
                "own_replay_bytes": {"belady": own_replay, "lru": ours.replay("lru")},
                "bytes_moved_ratio_vs_optimal": vs_optimal,
                "bytes_moved_ratio_vs_compulsory": ratio(ours.chunk_move_bytes, compulsory),
                "bytes_moved_ratio_vs_own_replay": ratio(ours.chunk_move_bytes, own_replay),
                "bytes_moved_ratio_vs_lru": ratio(
                    ours.chunk_move_bytes, lru.total_bytes - lru.streamed
                ),
                "checks": checks,
            }
            rows.append(
                [
                    key,
                    ours.capacity,
                    ours.chunk_move_bytes,
                    lru.total_bytes - lru.streamed,
                    own_replay,
                    optimum.bytes_moved,
                    compulsory,
                    ours.streamed,
                    vs_optimal,
                    ratio(ours.chunk_move_bytes, compulsory),
                ]
            )
            if not all(checks.values()):
                failed = [name for name, ok in checks.items() if not ok]
                print(f"warning: {key}: checks failed: {failed}", file=sys.stderr)
    print_table(
        "chunk bytes moved device<->host per steady-state iteration (exact, from the ledger); "
        "step streaming beside them",
        [
            "budget",
            "capacity B",
            "ours B",
            "LRU B",
            "own replay B",
            "optimal B",
            "compulsory B",
            "streamed B",
            "ours/opt",
            "ours/compulsory",
        ],
        rows,
    )
    for precision, smallest in details["min_trainable"].items():
        print(
            f"{precision}: smallest budget that trains {smallest['fraction']:.2f} of model "
            f"states; one moment's chunks + activations need {smallest['lower_bound_fraction']:.3f}"
            f" ({smallest['lower_bound_moment']})"
        )
    metrics = {
        "bytes_moved_ratio_vs_optimal": worst_vs_optimal,
        "bytes_moved_ratio_vs_compulsory": {
            key: run["bytes_moved_ratio_vs_compulsory"]
            for key, run in details["runs"].items()
            if run["trains"]
        },
        "min_trainable_budget_fraction": details["min_trainable"]["fp32"]["fraction"],
        "peak_device_bytes_over_capacity": peak_over_capacity,
    }
    details["goals"] = {"bytes_moved_ratio_vs_optimal": GOAL_RATIO_VS_OPTIMAL}
    details["all_checks_pass"] = all(
        all(run["checks"].values()) for run in details["runs"].values() if run["trains"]
    )
    path = write_results(args.json, metrics, details, args.quick)
    print(f"\n{metrics}\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
