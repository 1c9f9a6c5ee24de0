"""Bytes moved between device and host per iteration: our placement vs LRU vs offline Belady.

For device budgets of 30, 50 and 70% of the model-state bytes, a GPT trains on the simulated
device with our policy (Belady on the recorded trace) and with LRU; the same recorded trace
is then replayed offline with perfect knowledge of the future (farthest-next-use eviction),
which gives the Belady bound under the same per-moment budgets. Every number is an exact
byte count from the ledger, so one run is enough; the steady-state iterations agree exactly.

Headline keys use fp32, where parameter and gradient chunks do not all fit and the eviction
policy decides the traffic; bf16 rows (gradients in the parameter slot, 14 bytes/param)
are reported as details.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence

import torch

import chunkmem
from benchmarks._common import median, parse_args, print_table, write_results
from chunkmem.models.gpt import GPT, GPTConfig
from chunkmem.placement import simulate_traffic

FRACTIONS = (0.3, 0.5, 0.7)
STATE_BYTES = {"fp32": 16, "bf16": 14}


def run(
    model: GPT, precision: str, fraction: float, policy: str, batches: list, steady: int
) -> dict:
    capacity = int(model.config.num_parameters() * STATE_BYTES[precision] * fraction)
    engine = chunkmem.initialize(
        copy.deepcopy(model),
        config={
            "precision": precision,
            "device": {"type": "simulated", "capacity": capacity},
            "placement": {"policy": policy},
        },
    )
    for x, y in batches:
        engine.backward(engine(x, y))
        engine.step()
    iterations = range(len(batches) - steady, len(batches))
    result = {
        "capacity": capacity,
        "model_state_bytes": sum(engine.model_state_bytes().values()),
        "bytes_moved": median([engine.ledger.bytes_moved(i) for i in iterations]),
        "peak_over_capacity": engine.ledger.device.peak / capacity,
    }
    if policy == "belady":
        trace = engine.tracer.traces_for(next(iter(engine.tracer._traces)))[-1]
        nbytes = {c.id: c.nbytes for c in engine.residency.chunks.values()}
        static = engine.residency.static_device_bytes()
        budgets = [capacity - static - peak for peak in trace.nonmodel_peak]
        for offline in ("belady", "lru"):
            replay = simulate_traffic(trace, nbytes, budgets, offline)
            result[f"offline_{offline}"] = replay.bytes_moved
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("chunk_traffic", __doc__.splitlines()[0], argv)
    torch.manual_seed(0)
    layers, steady = (4, 2) if args.quick else (8, 3)
    config = GPTConfig(
        vocab_size=256, block_size=64, n_layer=layers, n_head=4, n_embd=128, checkpoint=True
    )
    model = GPT(config)
    # Two warm-up iterations: the first records the trace (and packs the chunks), the second
    # replays it once before the optimizer-state homes and the trace settle.
    data = torch.randint(0, 256, (2 + steady, 2, 65), generator=torch.Generator().manual_seed(0))
    batches = [(row[:, :-1].contiguous(), row[:, 1:].contiguous()) for row in data]
    rows, details = (
        [],
        {"model": config.__dict__, "parameters": config.num_parameters(), "runs": {}},
    )
    peak = 0.0
    for precision in ("fp32", "bf16"):
        for fraction in FRACTIONS:
            ours = run(model, precision, fraction, "belady", batches, steady)
            lru = run(model, precision, fraction, "lru", batches, steady)
            peak = max(peak, ours["peak_over_capacity"], lru["peak_over_capacity"])
            key = f"{precision}@{int(fraction * 100)}%"
            details["runs"][key] = {"ours": ours, "lru": lru}
            bound = ours["offline_belady"]
            rows.append(
                [
                    key,
                    ours["capacity"],
                    ours["bytes_moved"],
                    lru["bytes_moved"],
                    bound,
                    ours["bytes_moved"] / bound if bound else 1.0,
                    ours["bytes_moved"] / lru["bytes_moved"] if lru["bytes_moved"] else 1.0,
                ]
            )
    print_table(
        "bytes moved device<->host per steady-state iteration (exact, from the ledger)",
        ["budget", "capacity B", "ours B", "LRU B", "Belady bound B", "ours/Belady", "ours/LRU"],
        rows,
    )
    headline = details["runs"]["fp32@50%"]
    ours_50, lru_50 = headline["ours"]["bytes_moved"], headline["lru"]["bytes_moved"]
    bound_50 = headline["ours"]["offline_belady"]
    metrics = {
        "bytes_moved_ratio_vs_belady": ours_50 / bound_50 if bound_50 else 1.0,
        "bytes_moved_ratio_vs_lru": ours_50 / lru_50 if lru_50 else 1.0,
        "peak_device_bytes_over_capacity": peak,
    }
    path = write_results(args.json, metrics, details, args.quick)
    print(f"\n{metrics}\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
