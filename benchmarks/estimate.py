"""``chunkmem estimate`` against measured runs, the real allocator, the wire, and DeepSpeed's
estimator formulas as the anchor.

Cases (bf16, the simulated device large enough that nothing has to move; three steps each):

- **grid**: ZeRO stage 0, 1, 2, 3 x optimizer states on the device or on the host x two GPT
  sizes (the larger with activation checkpointing) x two micro-batches; stage 0 in one
  process, stages 1-3 on 2 gloo ranks.
- **zeropp**: stage 3 on 4 gloo ranks as 2 nodes x 2 with qwZ, hpZ, qgZ and all three.
- **nodes**: stage 2 on 4 gloo ranks as 2 nodes x 2, the step's gather of updated shards in
  two levels (``zero.step_gather_two_level``) and over one ring.
- **nvme**: the states on the NVMe tier (a directory here), in one process and at ZeRO-3
  on 2 ranks.
- **frozen**: a GPT whose embeddings and first half of blocks are frozen (fine-tuning the
  rest), in one process and at ZeRO-3 on 2 ranks.

Measured per rank from the engine's ledgers: peak device, host and NVMe bytes, peak
model-state bytes on the device (chunks only), the bytes sent in the third step's
collectives and their cross-node share. ``chunkmem.estimate.estimate`` predicts them without
training (``gpu=False``: the simulated device, no host staging of a real device). Keys:

- ``max_rel_error_estimate_vs_measured``: the largest |predicted - measured| / measured over
  every case of device peak, host peak, NVMe bytes, wire bytes and cross-node bytes (the
  worst rank). Goal <= 0.05.
- ``ledger_vs_allocator_peak_ratio``: the ledger's device peak plus host peak over the peak
  of live bytes in torch's CPU allocator (the profiler's memory events, from before the
  model is built), worst one-process case without NVMe (the NVMe tier's staging buffers are
  not torch allocations). On the simulated device every chunk and activation is a CPU
  tensor, so the allocator is a measurement the engine does not make itself. Goal >= 0.95.
  Every case runs with ``device.count_temporaries`` (operators' outputs counted while they
  live, as CUDA's allocator sees them), and the estimate counts them by the same rule. The
  peak is of what outlives the operator that allocated it (``tensor_peak``): a CPU without
  AVX-512 BF16 or AMX computes a bf16 matrix product in an fp32 buffer it frees before
  returning, which a GPU does not allocate and no count of operators' outputs can see (0.938
  of the raw peak on such a CPU, 0.984 on one with AMX). The raw ratio is reported beside it
  (``ledger_vs_allocator_peak_ratio_with_operator_scratch``).
- ``wire_bytes_ledger_vs_veth_ratio``: the ledger's cross-node bytes of the ZeRO++ case over
  the bytes the emulated cluster's veth pair transmitted in the same step
  (``benchmarks._wire_counters``); needs root and iproute2, otherwise reported as skipped.
  Its ranks may take ``SLACK`` (4) times what this run's loopback launch of the same world
  (2 nodes x 2, the ZeRO++ cases) took, no constant.

Phases: the one-process cases, one launch per world shape, then the veth pair. Each rewrites
the results file as it ends (the keys over the cases measured so far), so a failure later
keeps what was measured; ``details.phases`` says how each ended and why, and the exit status
is 1 unless every phase completed.
- ``max_rel_error_deepspeed_formula_vs_measured``: DeepSpeed's own estimators (deepspeed
  0.19.8), computed here from their formulas, against the measured peak *model-state* bytes
  on the device (their formula has no term for activations or buffers), over the grid:
  ``estimate_zero2_model_states_mem_needs`` (runtime/zero/stage_1_and_2.py) returns
  ``gpu_mem = 2 P + int(18 P / gpus)``, or ``2 P`` with ``cpu_offload``;
  ``estimate_zero3_model_states_mem_needs`` (runtime/zero/stage3.py) returns
  ``gpu_mem = 4 L + int(18 P / gpus)``, or ``4 L + int(2 P / gpus)`` with ``cpu_offload``
  and ``cpu_offload_params=False`` (states offloaded, parameters on the device, as here).
  P: parameters, L: the largest module's own parameters. Stage 0 takes the ZeRO-2 formula
  with one GPU, stage 1 the ZeRO-2 one. Where deepspeed is installed the formulas are
  checked against its functions. DeepSpeed publishes no estimator of wire bytes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import _wire_counters
from benchmarks._common import parse_args, print_table
from benchmarks.zeropp import Run, Skipped

CAPACITY = 8 * 2**30  # simulated: nothing has to move
STEPS = 3
ZEROPP = {
    "qwZ": {"quantized_weights": True},
    "hpZ": {"hpz_partition_size": 2},
    "qgZ": {"quantized_gradients": True},
    "qwZ+hpZ+qgZ": {"quantized_weights": True, "hpz_partition_size": 2, "quantized_gradients": True},
}  # fmt: skip
FULL = {
    "sizes": [
        {"layers": 4, "width": 128, "seq": 64, "checkpointing": False},
        {"layers": 8, "width": 256, "seq": 128, "checkpointing": True},
    ],
    "batches": [4, 16],
    "zeropp": list(ZEROPP),
}
# A minute here: one size and one batch, ZeRO++'s three techniques at once (the veth pair's
# case) and every other family.
QUICK = {
    "sizes": [{"layers": 4, "width": 128, "seq": 64, "checkpointing": True}],
    "batches": [2],
    "zeropp": ["qwZ+hpZ+qgZ"],
}
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "chunkmem"])


def frozen_gpt(layers: int, width: int, seq: int) -> nn.Module:
    """A GPT fine-tuned in its second half: embeddings (tied to the head) and the first
    ``layers // 2`` blocks frozen."""
    from chunkmem.models.gpt import GPT, GPTConfig

    model = GPT(
        GPTConfig(
            vocab_size=256, block_size=seq, n_layer=layers, n_head=max(1, width // 64),
            n_embd=width, checkpoint=True,
        )
    )  # fmt: skip
    model.requires_grad_(False)
    for block in model.blocks[layers // 2 :]:
        block.requires_grad_(True)
    model.ln_f.requires_grad_(True)
    return model


def cases(setup: dict[str, Any]) -> list[dict[str, Any]]:
    large = setup["sizes"][-1]
    frozen = {"build": "benchmarks.estimate:frozen_gpt", "seq": large["seq"],
              "kwargs": {key: large[key] for key in ("layers", "width", "seq")}}  # fmt: skip
    grid = [
        {
            "family": "grid",
            "stage": stage,
            "offload": offload,
            "model": size,
            "batch": batch,
            "world": 2 if stage else 1,
        }  # fmt: skip
        for stage in (0, 1, 2, 3)
        for offload in ("auto", "host")
        for size in setup["sizes"]
        for batch in setup["batches"]
    ]
    batch = setup["batches"][0]
    zeropp = [
        {
            "family": "zeropp",
            "name": name,
            "stage": 3,
            "offload": "auto",
            "model": large,
            "batch": batch,
            "world": 4,
            "node": 2,
            "zero": zero,
        }  # fmt: skip
        for name, zero in ZEROPP.items()
        if name in setup["zeropp"]
    ]
    # Stage 2 across nodes: the step's gather of updated shards in two levels and over one ring.
    nodes = [
        {
            "family": "nodes",
            "name": name,
            "stage": 2,
            "offload": "auto",
            "model": large,
            "batch": batch,
            "world": 4,
            "node": 2,
            "zero": {"step_gather_two_level": two_level},
        }  # fmt: skip
        for name, two_level in (("two levels", True), ("one ring", False))
    ]
    spread = [
        {
            "family": family,
            "stage": stage,
            "offload": offload,
            "model": model,
            "batch": batch,
            "world": 2 if stage else 1,
        }  # fmt: skip
        for family, offload, model in (("nvme", "nvme", large), ("frozen", "auto", frozen))
        for stage in (0, 3)
    ]
    return grid + zeropp + nodes + spread


def engine_config(case: dict[str, Any], nvme_directory: str | None = None) -> dict[str, Any]:
    offload: dict[str, Any] = {"optimizer": case["offload"]}
    if case["offload"] == "nvme":
        offload["nvme"] = {"path": nvme_directory or "unused", "block_size": 1 << 20}
    zero = {"stage": case["stage"], "timeout_s": 600, **case.get("zero", {})}
    if case.get("node"):
        zero["node_size"] = case["node"]
    return {
        "precision": "bf16",
        "device": {"type": "simulated", "capacity": CAPACITY, "count_temporaries": True},
        "zero": zero,
        "offload": offload,
    }


def measure(case: dict[str, Any], nvme_directory: str | None, allocator: bool) -> dict[str, int]:
    """Train STEPS steps; this rank's ledger peaks, wire bytes of the last step and, with
    ``allocator``, the CPU allocator's peak of live bytes from the model's construction to the
    end of the last step (``engine.close`` writes the weights back into the module: not
    training)."""
    gc.collect()  # an earlier case's garbage freed while profiled would offset the sum
    profiler = allocator_profiler() if allocator else contextlib.nullcontext()
    with profiler:
        engine = _train(case, nvme_directory)
    ledger = engine.ledger
    comm = getattr(engine.states.sharding, "comm", None)
    result = {
        "device_peak": ledger.device.peak,
        "model_state_peak": ledger.device.peak_model,
        "host_peak": ledger.tiers["host"].peak,
        "nvme_peak": ledger.tiers["nvme"].peak if "nvme" in ledger.tiers else 0,
        "wire": comm.ledger.bytes_sent(tag=STEPS - 1) if comm is not None else 0,
        "cross_node": comm.ledger.cross_node_bytes(tag=STEPS - 1) if comm is not None else 0,
    }
    engine.close()
    if allocator:
        result["allocator_peak"] = tensor_peak(profiler)
        result["allocator_peak_with_operator_scratch"] = allocator_peak(profiler)
    return result


def _train(case: dict[str, Any], nvme_directory: str | None) -> Any:
    import chunkmem
    from chunkmem.cli.models import build_model
    from chunkmem.cli.settings import ModelSettings

    torch.manual_seed(0)
    model = build_model(ModelSettings(**case["model"]))
    engine = chunkmem.initialize(model, config=engine_config(case, nvme_directory))
    generator = torch.Generator().manual_seed(1)
    seq = case["model"]["seq"]
    for _ in range(STEPS):
        rows = torch.randint(0, 256, (case["batch"], seq + 1), generator=generator)
        loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        engine.step()
        del loss, rows
    return engine


def allocator_profiler() -> torch.profiler.profile:
    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )


def allocator_peak(profiler: torch.profiler.profile) -> int:
    """The most bytes live at once in torch's CPU allocator while profiled: the running sum of
    the profiler's allocation (+) and free (-) events in time order."""
    events = [e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def tensor_peak(profiler: torch.profiler.profile) -> int:
    """The allocator's peak over what outlives the operator that allocated it: an allocation
    freed before its innermost ``aten::`` operator returns is that operator's scratch, which no
    count of operators' outputs can see. Where the CPU has no native bf16 (no AVX-512 BF16 or
    AMX), a bf16 matrix product accumulates into an fp32 buffer it frees on return: 1 MiB for
    a 512x512 output, 6% of the peak of
    ``tests/test_temporaries.py``'s run. The ledger is judged against the rest."""
    events = profiler.profiler.kineto_results.events()
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    operators: dict[int, list] = defaultdict(list)  # by thread, by start (outer ones first)
    for event in events:
        if event.name().startswith("aten::"):
            operators[event.start_thread_id()].append(event)
    for started in operators.values():
        started.sort(key=lambda e: (e.start_ns(), -e.duration_ns()))
    open_operators: dict[int, list] = defaultdict(list)
    next_operator: dict[int, int] = defaultdict(int)
    allocated_in: dict[tuple[int, int], list[int]] = defaultdict(list)
    scratch: set[int] = set()
    for index, event in enumerate(memory):
        thread, now = event.start_thread_id(), event.start_ns()
        stack, started = open_operators[thread], operators[thread]
        while (
            next_operator[thread] < len(started)
            and started[next_operator[thread]].start_ns() <= now
        ):
            while stack and stack[-1].end_ns() < started[next_operator[thread]].start_ns():
                stack.pop()
            stack.append(started[next_operator[thread]])
            next_operator[thread] += 1
        while stack and stack[-1].end_ns() < now:
            stack.pop()
        if not stack:
            continue
        key = (id(stack[-1]), abs(event.nbytes()))
        if event.nbytes() > 0:
            allocated_in[key].append(index)
        elif allocated_in[key]:
            scratch.update((allocated_in[key].pop(), index))
    live = peak = 0
    for index, event in enumerate(memory):
        if index not in scratch:
            live += event.nbytes()
            peak = max(peak, live)
    return peak


def rank_main(
    rank: int, world: int, node: int | None, store: str, todo: list[dict[str, Any]], scratch: str
) -> None:
    torch.set_num_threads(1)
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank % (node or world)), "WORLD_SIZE": str(world)}
    if node:
        env["LOCAL_WORLD_SIZE"] = str(node)
    os.environ.update(env)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = [measure(case, f"{scratch}/nvme", allocator=False) for case in todo]
    Path(scratch, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def measure_distributed(todo: list[dict[str, Any]], world: int, node: int | None) -> list[dict]:
    """Each case on ``world`` ranks; per case the worst rank's numbers, and the cross-node
    bytes of all ranks."""
    with tempfile.TemporaryDirectory() as scratch:
        store = str(Path(scratch) / "store")
        ranks = [
            _CONTEXT.Process(target=rank_main, args=(r, world, node, store, todo, scratch))
            for r in range(world)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
            if process.exitcode:
                raise RuntimeError(f"a rank exited with code {process.exitcode}")
        per_rank = [json.loads(Path(scratch, f"rank{r}.json").read_text()) for r in range(world)]
    combined = []
    for i in range(len(todo)):
        worst = {key: max(rank[i][key] for rank in per_rank) for key in per_rank[0][i]}
        worst["cross_node_all_ranks"] = sum(rank[i]["cross_node"] for rank in per_rank)
        combined.append(worst)
    return combined


def predict(case: dict[str, Any]) -> Any:
    from chunkmem.cli.settings import ModelSettings
    from chunkmem.config import Config
    from chunkmem.estimate import estimate

    return estimate(
        ModelSettings(**case["model"]),
        Config.from_dict(engine_config(case)),
        batch=case["batch"],
        world_size=case["world"],
        node_size=case.get("node"),
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
    return total, largest, case["world"]


def deepspeed_formula(case: dict[str, Any]) -> int:
    """DeepSpeed's per-GPU model-state bytes for the case (see the module docstring)."""
    total, largest, gpus = deepspeed_inputs(case)
    offload = case["offload"] == "host"
    if case["stage"] == 3:
        states = 2 * total if offload else 18 * total
        return 4 * largest + int(states / gpus)
    return 2 * total if offload else 2 * total + int(18 * total / gpus)


def check_against_deepspeed(case: dict[str, Any], ours: int) -> None:
    """Where deepspeed is installed, its functions must give the formula's number."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:
        return
    total, largest, gpus = deepspeed_inputs(case)
    offload = case["offload"] == "host"
    if case["stage"] == 3:
        theirs = estimate_zero3_model_states_mem_needs(
            total, largest, num_gpus_per_node=gpus, cpu_offload=offload, cpu_offload_params=False
        )[1]
    else:
        theirs = estimate_zero2_model_states_mem_needs(
            total, num_gpus_per_node=gpus, cpu_offload=offload
        )[1]
    assert theirs == ours, f"DeepSpeed says {theirs}, the formula {ours} for {case}"


def label(case: dict[str, Any]) -> str:
    model = case["model"]
    if case["family"] == "frozen":
        shape = f"frozen {model['kwargs']['layers']}x{model['kwargs']['width']}"
    else:
        shape = f"{model['layers']}x{model['width']}{'+ckpt' if model['checkpointing'] else ''}"
    where = {"auto": "dev ", "host": "host", "nvme": "nvme"}[case["offload"]]
    extra = f" {case['name']} 2x2" if case["family"] in ("zeropp", "nodes") else ""
    return f"z{case['stage']} {where} {shape} b{case['batch']}{extra}"


def relative(predicted: int, measured: int) -> float:
    return abs(predicted - measured) / measured if measured else float(predicted != 0)


def shape_phase(world: int, node: int) -> str:
    """The phase name of one launch: ``ranks_2``, ``ranks_4_as_2x2``."""
    return f"ranks_{world}" + (f"_as_{world // node}x{node}" if node else "")


def measure_in_phases(run: Run, todo: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """Every case, each group a phase whose rows join ``run.details["cases"]`` as it ends:
    one-process ones here (the allocator profiled where it sees every tier), the others in one
    launch per world shape. Returns each launch's seconds, by (world, node)."""
    rows = run.details["cases"]
    with run.phase("one_process"), tempfile.TemporaryDirectory() as scratch:
        for case in (c for c in todo if c["world"] == 1):
            rows.append(compare(case, measure(case, scratch, case["offload"] != "nvme")))
    launch_s: dict[tuple[int, int], float] = {}
    shapes = sorted({(c["world"], c.get("node") or 0) for c in todo if c["world"] > 1})
    for world, node in shapes:
        with run.phase(shape_phase(world, node)):
            group = [c for c in todo if c["world"] == world and (c.get("node") or 0) == node]
            started = time.monotonic()
            results = measure_distributed(group, world, node or None)
            launch_s[world, node] = time.monotonic() - started
            rows.extend(compare(c, got) for c, got in zip(group, results, strict=True))
    return launch_s


def compare(case: dict[str, Any], got: dict[str, int]) -> dict[str, Any]:
    estimate = predict(case)
    memory, wire = estimate.memory, estimate.wire
    row: dict[str, Any] = {
        "case": label(case),
        **case,
        "measured": got,
        "estimated": {
            "device_peak": memory.peak_device_bytes,
            "host_peak": memory.peak_host_bytes,
            "nvme_peak": memory.nvme_bytes,
            "wire": wire.bytes_per_rank,
            "cross_node": wire.cross_node_bytes_per_rank,
            "cross_node_all_ranks": wire.cross_node_bytes_all_ranks,
        },
    }
    errors = {
        key: relative(row["estimated"][key], got[key])
        for key in ("device_peak", "host_peak", "nvme_peak", "wire", "cross_node")
    }
    row["rel_error"] = errors
    if case["family"] == "grid":
        formula = deepspeed_formula(case)
        check_against_deepspeed(case, formula)
        row["deepspeed_gpu_mem_bytes"] = formula
        row["rel_error_deepspeed_model_states"] = relative(formula, got["model_state_peak"])
    if "allocator_peak" in got:
        ledger = got["device_peak"] + got["host_peak"]
        row["ledger_vs_allocator"] = ledger / got["allocator_peak"]
        row["ledger_vs_allocator_with_operator_scratch"] = (
            ledger / got["allocator_peak_with_operator_scratch"]
        )
    return row


def summarize(details: dict[str, Any]) -> dict[str, Any]:
    """The keys from the cases measured so far (None where none was)."""
    rows = details["cases"]

    def worst(values: list[float]) -> float | None:
        return max(values) if values else None

    errors = {
        key: worst([row["rel_error"][key] for row in rows])
        for key in ("device_peak", "host_peak", "nvme_peak", "wire", "cross_node")
    }

    def least(key: str) -> float | None:
        values = [row[key] for row in rows if key in row]
        return min(values) if values else None

    return {
        "max_rel_error_estimate_vs_measured": worst([e for e in errors.values() if e is not None]),
        "ledger_vs_allocator_peak_ratio": least("ledger_vs_allocator"),
        "ledger_vs_allocator_peak_ratio_with_operator_scratch": least(
            "ledger_vs_allocator_with_operator_scratch"
        ),
        "wire_bytes_ledger_vs_veth_ratio": (details.get("veth") or {}).get("ledger_vs_veth_ratio"),
        "max_rel_error_deepspeed_formula_vs_measured": worst(
            [row["rel_error_deepspeed_model_states"] for row in rows if row["family"] == "grid"]
        ),
        **{f"max_rel_error_estimate_{key}": value for key, value in errors.items()},
    }


def print_cases(rows: list[dict[str, Any]]) -> None:
    print_table(
        "per rank: peak device, host and NVMe bytes, wire bytes per step (bf16); relative errors",
        [
            "case",
            "device",
            "err",
            "host",
            "err",
            "nvme",
            "wire",
            "err",
            "cross err",
            "ds err",
            "ledger/alloc",
        ],  # fmt: skip
        [
            [
                row["case"],
                row["measured"]["device_peak"],
                row["rel_error"]["device_peak"],
                row["measured"]["host_peak"],
                row["rel_error"]["host_peak"],
                row["measured"]["nvme_peak"],
                row["measured"]["wire"],
                row["rel_error"]["wire"],
                row["rel_error"]["cross_node"],
                row.get("rel_error_deepspeed_model_states", "-"),
                row.get("ledger_vs_allocator", "-"),
            ]  # fmt: skip
            for row in rows
        ],
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Each phase rewrites the results file as it ends, so a later failure keeps what was
    measured; ``details.phases`` says how each ended, and the exit status is 1 unless all
    did."""
    args = parse_args("estimate", __doc__.splitlines()[0], argv)
    setup = QUICK if args.quick else FULL
    details: dict[str, Any] = {"phases": {}, "cases": [], "capacity": CAPACITY, "veth": None}
    run = Run(args.json, args.quick, details, summarize=summarize)
    launch_s = measure_in_phases(run, cases(setup))
    print_cases(details["cases"])
    with run.phase("veth"):
        shape = (_wire_counters.WORLD, _wire_counters.PER_NODE)
        if shape not in launch_s:
            raise Skipped(f"needs the {shape_phase(*shape)} phase, which did not complete")
        veth = details["veth"] = _wire_counters.measure_cluster(
            ZEROPP["qwZ+hpZ+qgZ"], setup["sizes"][-1], setup["batches"][0], launch_s[shape]
        )
        if "skipped" in veth:
            raise Skipped(veth["skipped"])
        if "failed" in veth:
            raise RuntimeError(veth["failed"])
    for key, value in summarize(details).items():
        print(f"{key}: {value}")
    print(f"results: {args.json}")
    return 0 if run.succeeded() else 1


if __name__ == "__main__":
    sys.exit(main())
