"""The largest GPT that trains within a fixed device capacity and host budget.

Both tiers are accounted by the same ledger (the simulated device and a capacity-limited
host), so "trains" means: three steps (warm-up, re-trace, steady) without any tier exceeding
its capacity. Depth grows at a fixed width; a bisection finds the deepest model that trains.
The figure of merit is model-state bytes (14 per parameter in bf16 with fp32 masters and Adam
moments, the ZeRO accounting) over the memory given (device capacity + host budget).
PatrickStar's published runs reach about 0.5 of CPU+GPU memory.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence

import torch

import chunkmem
from benchmarks._common import parse_args, print_table, write_results
from chunkmem.errors import CapacityError, OutOfMemoryError
from chunkmem.models.gpt import GPT, GPTConfig

STATE_BYTES_PER_PARAM = 14


def attempt(config: GPTConfig, device_bytes: int, host_bytes: int) -> dict | None:
    """Train three steps; the ledger's account of the run, or None if it does not fit."""
    torch.manual_seed(0)
    model = GPT(config)
    data = torch.randint(0, config.vocab_size, (3, 1, config.block_size + 1))
    try:
        engine = chunkmem.initialize(
            model,
            config={
                "precision": "bf16",
                "device": {"type": "simulated", "capacity": device_bytes},
                "host": {"capacity": host_bytes},
            },
        )
        for row in data:
            engine.backward(engine(row[:, :-1], row[:, 1:]))
            engine.step()
    except (OutOfMemoryError, CapacityError):
        return None
    finally:
        del model
        gc.collect()
    return {
        "parameters": config.num_parameters(),
        "chunk_bytes": sum(engine.model_state_bytes().values()),
        "device_peak": engine.ledger.device.peak,
        "host_peak": engine.ledger.tiers["host"].peak,
        "bytes_moved_per_iteration": engine.ledger.bytes_moved(2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("max_model", __doc__.splitlines()[0], argv)
    if args.quick:
        device_bytes, host_bytes, width = 8 * 2**20, 32 * 2**20, 128
    else:
        device_bytes, host_bytes, width = 32 * 2**20, 128 * 2**20, 256
    budget = device_bytes + host_bytes

    def config(layers: int) -> GPTConfig:
        return GPTConfig(
            vocab_size=256, block_size=32, n_layer=layers, n_head=4, n_embd=width, checkpoint=True
        )

    # Bisect on depth between one layer and the depth whose model states alone fill the budget.
    per_layer = config(2).num_parameters() - config(1).num_parameters()
    low, high = 0, budget // (STATE_BYTES_PER_PARAM * per_layer) + 1
    results: dict[int, dict | None] = {}
    while high - low > 1:
        middle = (low + high) // 2
        results[middle] = attempt(config(middle), device_bytes, host_bytes)
        print(
            f"  {middle:3d} layers: {'trains' if results[middle] else 'does not fit'}", flush=True
        )
        low, high = (middle, high) if results[middle] else (low, middle)
    if low == 0:
        raise SystemExit("even a one-layer model does not fit; raise the budgets")
    best = results[low]
    assert best is not None
    model_state_bytes = STATE_BYTES_PER_PARAM * best["parameters"]
    metrics = {"model_state_fraction_of_memory": model_state_bytes / budget}
    details = {
        "device_capacity": device_bytes,
        "host_budget": host_bytes,
        "width": width,
        "layers": low,
        "model_state_bytes": model_state_bytes,
        "attempts": {str(k): v for k, v in sorted(results.items())},
        **best,
    }
    print_table(
        "largest GPT that trains (bf16, fp32 masters, Adam)",
        ["device", "host", "layers", "params", "model states", "fraction", "device peak", "host peak"],
        [[device_bytes, host_bytes, low, best["parameters"], model_state_bytes,
          metrics["model_state_fraction_of_memory"], best["device_peak"], best["host_peak"]]],
    )  # fmt: skip
    path = write_results(args.json, metrics, details, args.quick)
    print(f"\n{metrics}\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
