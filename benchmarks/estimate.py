"""``chunkmem estimate`` against measured runs, and DeepSpeed's estimator formulas as the anchor.

For every case (ZeRO stage 0, 1, 2, 3; optimizer states on the device or offloaded to the
host; two GPT sizes, the larger one with activation checkpointing; two micro-batch sizes;
bf16, where DeepSpeed's formulas apply) the engine trains three steps on a simulated device
large enough that nothing has to move (stage 0 in one process, stages 1-3 on 2 gloo ranks)
and the ledgers give, per rank:

- the peak device bytes of the run (chunks, workspaces and activations: the ledger's peak);
- the bytes the rank sent in the collectives of the third step (the communication ledger).

``chunkmem.estimate.estimate`` predicts both without training, for the simulated device
(``gpu=False``: no host staging buffers). Keys:

- ``max_rel_error_estimate_vs_measured``: the largest |predicted - measured| / measured over
  every case, of peak device bytes and of wire bytes (the worst rank). Goal <= 0.10.
- ``max_rel_error_deepspeed_formula_vs_measured``: the same for peak device bytes, predicted
  by DeepSpeed's own estimators (deepspeed 0.19.8), computed here from their formulas:
  ``estimate_zero2_model_states_mem_needs`` (runtime/zero/stage_1_and_2.py, lines 4017-4034)
  returns ``gpu_mem = 2 P + int(18 P / gpus)``, or ``2 P`` with ``cpu_offload``;
  ``estimate_zero3_model_states_mem_needs`` (runtime/zero/stage3.py, lines 4016-4052)
  returns ``gpu_mem = 4 L + int(18 P / gpus)``, or ``4 L + int(2 P / gpus)`` with
  ``cpu_offload`` and ``cpu_offload_params=False`` (the states offloaded, the parameters on
  the device, as here). P: parameters, L: the largest module's own parameters (their
  ``model_to_params``). Stage 0 takes the ZeRO-2 formula with one GPU (nothing partitioned),
  stage 1 the ZeRO-2 one (DeepSpeed's file covers both stages). Their ``gpu_mem`` is
  compared with our measured per-rank peak device bytes: it is the number they print as
  "per GPU" for model states; it has no term for activations. DeepSpeed publishes no
  estimator of wire bytes. Where deepspeed is installed the formulas are checked against
  its functions.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import parse_args, print_table, write_results

CAPACITY = 8 * 2**30  # simulated: nothing has to move
STEPS = 3
WORLD = 2
FULL = {
    "sizes": [
        {"layers": 4, "width": 128, "seq": 64, "checkpointing": False},
        {"layers": 8, "width": 256, "seq": 128, "checkpointing": True},
    ],
    "batches": [4, 16],
}
QUICK = {
    "sizes": [
        {"layers": 2, "width": 64, "seq": 32, "checkpointing": False},
        {"layers": 4, "width": 128, "seq": 64, "checkpointing": True},
    ],
    "batches": [2, 8],
}
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "chunkmem"])


def cases(setup: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"stage": stage, "offload": offload, "model": size, "batch": batch}
        for stage in (0, 1, 2, 3)
        for offload in (False, True)
        for size in setup["sizes"]
        for batch in setup["batches"]
    ]


def engine_config(case: dict[str, Any]) -> dict[str, Any]:
    return {
        "precision": "bf16",
        "device": {"type": "simulated", "capacity": CAPACITY},
        "zero": {"stage": case["stage"], "timeout_s": 600},
        "offload": {"optimizer": "host" if case["offload"] else "auto"},
    }


def measure(case: dict[str, Any]) -> dict[str, int]:
    """Train STEPS steps; this rank's peak device and host bytes, and wire bytes of the last."""
    import chunkmem
    from chunkmem.cli.models import build_model
    from chunkmem.cli.settings import ModelSettings

    torch.manual_seed(0)
    model = build_model(ModelSettings(**case["model"]))
    engine = chunkmem.initialize(model, config=engine_config(case))
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        rows = torch.randint(0, 256, (case["batch"], case["model"]["seq"] + 1), generator=generator)
        loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        engine.step()
    ledger = engine.ledger
    comm = getattr(engine.states.sharding, "comm", None)
    result = {
        "device_peak": ledger.device.peak,
        "host_peak": ledger.tiers["host"].peak,
        "wire": comm.ledger.bytes_sent(tag=STEPS - 1) if comm is not None else 0,
    }
    engine.close()
    return result


def rank_main(rank: int, port: int, store: str, todo: list[dict[str, Any]], out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )  # fmt: skip
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    results = [measure(case) for case in todo]
    Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def measure_distributed(todo: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Each case on WORLD ranks; per case the worst rank's numbers."""
    from chunkmem.cli.launch import free_port

    with tempfile.TemporaryDirectory() as scratch:
        outs = [str(Path(scratch) / f"rank{r}.json") for r in range(WORLD)]
        store = str(Path(scratch) / "store")
        port = free_port()
        ranks = [
            _CONTEXT.Process(target=rank_main, args=(r, port, store, todo, outs[r]))
            for r in range(WORLD)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
            if process.exitcode:
                raise RuntimeError(f"a rank exited with code {process.exitcode}")
        per_rank = [json.loads(Path(out).read_text()) for out in outs]
    return [
        {key: max(rank[i][key] for rank in per_rank) for key in per_rank[0][i]}
        for i in range(len(todo))
    ]


def predict(case: dict[str, Any]) -> Any:
    from chunkmem.cli.settings import ModelSettings
    from chunkmem.config import Config
    from chunkmem.estimate import estimate

    return estimate(
        ModelSettings(**case["model"]),
        Config.from_dict(engine_config(case)),
        batch=case["batch"],
        world_size=WORLD if case["stage"] else 1,
        device_capacity=CAPACITY,
        gpu=False,
    )


def deepspeed_inputs(case: dict[str, Any]) -> tuple[int, int, int]:
    """What DeepSpeed's estimators take: parameters, the largest module's own parameters
    (their ``model_to_params``), and GPUs (one at stage 0, nothing partitioned)."""
    from chunkmem.cli.models import build_model
    from chunkmem.cli.settings import ModelSettings

    with torch.device("meta"):
        model = build_model(ModelSettings(**case["model"]))
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest, WORLD if case["stage"] else 1


def deepspeed_formula(case: dict[str, Any]) -> int:
    """DeepSpeed's per-GPU model-state bytes for the case (see the module docstring)."""
    total, largest, gpus = deepspeed_inputs(case)
    if case["stage"] == 3:
        states = 2 * total if case["offload"] else 18 * total
        return 4 * largest + int(states / gpus)
    return 2 * total if case["offload"] else 2 * total + int(18 * total / gpus)


def check_against_deepspeed(case: dict[str, Any], ours: int) -> None:
    """Where deepspeed is installed, its functions must give the formula's number."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:
        return
    total, largest, gpus = deepspeed_inputs(case)
    if case["stage"] == 3:
        theirs = estimate_zero3_model_states_mem_needs(
            total, largest, num_gpus_per_node=gpus, cpu_offload=case["offload"],
            cpu_offload_params=False,
        )[1]  # fmt: skip
    else:
        theirs = estimate_zero2_model_states_mem_needs(
            total, num_gpus_per_node=gpus, cpu_offload=case["offload"]
        )[1]
    assert theirs == ours, f"DeepSpeed says {theirs}, the formula {ours} for {case}"


def label(case: dict[str, Any]) -> str:
    model = case["model"]
    checkpointing = "+ckpt" if model["checkpointing"] else ""
    return (
        f"z{case['stage']} {'host' if case['offload'] else 'dev '} "
        f"{model['layers']}x{model['width']}{checkpointing} b{case['batch']}"
    )


def relative(predicted: int, measured: int) -> float:
    return abs(predicted - measured) / measured if measured else float(predicted != 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("estimate", __doc__.splitlines()[0], argv)
    setup = QUICK if args.quick else FULL
    todo = cases(setup)
    single = [case for case in todo if case["stage"] == 0]
    spread = [case for case in todo if case["stage"]]
    measured = dict(zip(map(label, single), map(measure, single), strict=True))
    measured.update(zip(map(label, spread), measure_distributed(spread), strict=True))
    rows, details = [], []
    for case in todo:
        got = measured[label(case)]
        estimate = predict(case)
        formula = deepspeed_formula(case)
        check_against_deepspeed(case, formula)
        row = {
            "case": label(case),
            **case,
            "measured_peak_device_bytes": got["device_peak"],
            "estimated_peak_device_bytes": estimate.memory.peak_device_bytes,
            "deepspeed_gpu_mem_bytes": formula,
            "measured_wire_bytes": got["wire"],
            "estimated_wire_bytes": estimate.wire.bytes_per_rank,
            "measured_host_peak_bytes": got["host_peak"],
            "estimated_host_first_cycle_bytes": estimate.memory.first_cycle_host_bytes,
            "rel_error_device": relative(estimate.memory.peak_device_bytes, got["device_peak"]),
            "rel_error_wire": relative(estimate.wire.bytes_per_rank, got["wire"]),
            "rel_error_deepspeed": relative(formula, got["device_peak"]),
        }
        details.append(row)
        rows.append(
            [
                row["case"],
                got["device_peak"],
                row["estimated_peak_device_bytes"],
                formula,
                got["wire"],
                row["estimated_wire_bytes"],
                row["rel_error_device"],
                row["rel_error_deepspeed"],
            ]
        )
    print_table(
        "per-rank peak device bytes and wire bytes per step (bf16)",
        ["case", "measured", "estimate", "deepspeed", "wire", "wire est.", "err", "ds err"],
        rows,
    )
    metrics = {
        "max_rel_error_estimate_vs_measured": max(
            max(r["rel_error_device"], r["rel_error_wire"]) for r in details
        ),
        "max_rel_error_deepspeed_formula_vs_measured": max(
            r["rel_error_deepspeed"] for r in details
        ),
        "max_rel_error_estimate_device_bytes": max(r["rel_error_device"] for r in details),
        "max_rel_error_estimate_wire_bytes": max(r["rel_error_wire"] for r in details),
    }
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}")
    path = write_results(args.json, metrics, {"cases": details, "capacity": CAPACITY}, args.quick)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
