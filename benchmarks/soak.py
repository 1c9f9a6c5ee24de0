"""Long runs: resident memory of the demo model over thousands of steps, one process and ZeRO-2.

The demo's GPT (4 layers x 128, checkpointing, fp32) trains on Python's stdlib sources with a
device of 40% of its model-state bytes, so chunks move every step, and with the report's
event lists at their default cap. Batches are 2 x 32 tokens, smaller than the demo's, so that
thousands of steps fit in the time: what is measured is growth per step, not per token. RSS is
sampled (after ``gc.collect()``) every ``interval`` steps; the growth after warm-up is the last
sample minus the one at the end of warm-up. ZeRO-2 runs the same loop on 2 gloo ranks (each
rank its own slice), at the same time as the one-process run, and reports the larger growth of
the two ranks.

Full: 10,000 steps, warm-up 1,000, a sample every 500. --quick: 1,000 steps, warm-up 500 (by
then the report's event lists are full), a sample every 100: a few minutes rather than one,
since a leak must show over many steps.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import chunkmem
from benchmarks._common import parse_args, print_table, write_results
from chunkmem.cli.data import batches, stdlib_text
from chunkmem.models.gpt import GPT, GPTConfig

DEVICE_FRACTION = 0.4
DEMO_MODEL = GPTConfig(
    vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=128, checkpoint=True
)
FULL = {"model": DEMO_MODEL, "batch": 2, "steps": 10_000, "warmup": 1_000, "interval": 500}
# --quick: the report's event lists (20,000 each) fill by step ~450 of this model, so growth is
# read after step 500.
QUICK = {"model": DEMO_MODEL, "batch": 2, "steps": 1_000, "warmup": 500, "interval": 100}


def rss_bytes() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def soak(setup: dict, stage: int, rank: int, world: int) -> dict:
    """Train ``setup["steps"]`` steps; RSS samples and the size of the report at the end."""
    torch.manual_seed(0)
    config_model = setup["model"]
    model = GPT(config_model)
    capacity = int(config_model.num_parameters() * 16 * DEVICE_FRACTION)
    config = {"device": {"type": "simulated", "capacity": capacity}, "optimizer": {"lr": 1e-3}}
    if stage:
        config["zero"] = {"stage": stage, "timeout_s": 120}
    engine = chunkmem.initialize(model, config=config)
    data = torch.tensor(list(stdlib_text(1_000_000)), dtype=torch.long)
    stream = batches(
        data, setup["batch"], config_model.block_size, torch.Generator().manual_seed(1 + rank)
    )
    samples: list[tuple[int, int]] = []
    for step in range(1, setup["steps"] + 1):
        x, y = next(stream)
        engine.backward(engine(x, y))
        engine.step()
        if step % setup["interval"] == 0:
            samples.append((step, rss_bytes()))
    with tempfile.TemporaryDirectory() as report_dir:
        sizes = {p.name: p.stat().st_size for p in engine.write_report(report_dir).values()}
    ledger = engine.ledger
    return {
        "rss_samples": samples,
        "report_bytes": sizes,
        "ledger_events": {
            "moves": len(ledger.moves),
            "allocations": len(ledger.allocations),
            "moment_samples": len(ledger.moment_samples),
        },
    }


def growth_after_warmup(samples: list[tuple[int, int]], warmup: int) -> int:
    at_warmup = next(rss for step, rss in samples if step >= warmup)
    return samples[-1][1] - at_warmup


def zero2_rank(rank: int, setup: dict, store: str, out: str) -> None:
    torch.set_num_threads(1)  # two ranks share two cores
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    result = soak(setup, stage=2, rank=rank, world=2)
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("soak", __doc__.splitlines()[0], argv)
    setup = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory() as work:
        # The ZeRO-2 ranks soak while this process soaks alone: each measures its own RSS,
        # which another process's work does not change, and the run takes the longer half's
        # time rather than the sum.
        zero2 = mp.spawn(
            zero2_rank, args=(setup, f"{work}/store", f"{work}/out"), nprocs=2, join=False
        )
        try:
            single = soak(setup, stage=0, rank=0, world=1)
        except BaseException:
            for process in zero2.processes:
                process.terminate()
            raise
        while not zero2.join():  # raises, naming the rank, if one failed
            pass
        ranks = [json.loads(Path(f"{work}/out.{rank}").read_text()) for rank in range(2)]
    growth = growth_after_warmup(single["rss_samples"], setup["warmup"])
    zero2 = [growth_after_warmup(r["rss_samples"], setup["warmup"]) for r in ranks]
    metrics = {
        "rss_growth_bytes_after_warmup": growth,
        "zero2_rss_growth_bytes_after_warmup": max(zero2),
    }
    rows = [["one process", *(rss for _step, rss in single["rss_samples"][-3:]), growth]]
    rows += [
        [f"ZeRO-2 rank {rank}", *(rss for _s, rss in r["rss_samples"][-3:]), zero2[rank]]
        for rank, r in enumerate(ranks)
    ]
    model = setup["model"]
    print_table(
        f"RSS over {setup['steps']:,} steps of GPT {model.n_layer}x{model.n_embd} "
        f"(device {DEVICE_FRACTION:.0%} of model states), growth after step {setup['warmup']:,}",
        ["run", "RSS (3rd last)", "RSS (2nd last)", "RSS (last)", "growth bytes"],
        rows,
    )
    details = {
        **setup,
        "model": model.__dict__,
        "single_process": single,
        "zero2_ranks": ranks,
        "goal_bytes": 2**20,
    }
    path = write_results(args.json, metrics, details, args.quick)
    print(f"\n{metrics}\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
