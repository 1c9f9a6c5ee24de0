"""ZeRO at the scale people run it: the first iteration's memory, one gather per use under
activation checkpointing, padding, frozen weights, and the checkpointed step against FSDP2
and DeepSpeed.

- **Estimator rows**: GPT 32x4096 on 64 ranks and GPT 80x8192 on 512 ranks (bf16, sequence
  2048, activation checkpointing, micro-batch 1, 8 ranks a node, 80 GiB devices), through
  ``chunkmem estimate`` (the engine's own packing and strategies). The first iteration's peak
  against the steady one's, device and host (0 B against 0 B counts as equal); ZeRO-3's
  all-gather bytes per step against two gathers of the parameters (2 x bytes x (N-1)/N,
  written from the model's parameter count, not from our packing).
- **Engine rows**: 4 gloo ranks (processes), GPT with checkpointing in bf16 at ZeRO-2 and
  ZeRO-3; per-iteration peaks from the ledger, all-gather bytes from the communication
  ledger.
- **Padding**: the chunk layouts of GPT 32x4096 and 80x8192 (first-use order, through the
  estimator), Llama-3-8B and Llama-2-70B (grouped-query attention) and LoRA on Llama-3-8B
  (registration order), 8 ranks.
- **LoRA**: a Hugging Face Llama (4 layers, width 256) with PEFT r=8 adapters on q/k/v/o,
  fp32: model-state bytes at the end of backward against frozen weights at 4 bytes and
  adapters at 16 (parameter, gradient, two Adam moments).
- **Step time**: 2 gloo ranks, GPT 10x640 with activation checkpointing in every framework:
  our ZeRO-3 (the model's own non-reentrant checkpointing), FSDP2 (``fully_shard`` per block
  and ``checkpoint_wrapper``) and DeepSpeed ZeRO-3 (the model's checkpointing; tuned as in
  ``benchmarks/zero_vs_peers``), one framework at a time, forward then reversed order over
  rounds; medians and ranges of steps timed between barriers. Each on its own collectives
  over gloo except ours, whose point-to-point rings are the transport advantage
  ``benchmarks/zero_vs_peers`` measures apart (``stage3_builtin_step_time_ratio_vs_fsdp2``).
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._common import parse_args, print_table, write_results
from benchmarks.zero_vs_peers import deepspeed_config
from chunkmem.cli.settings import ModelSettings
from chunkmem.config import Config
from chunkmem.estimate import estimate
from chunkmem.models.gpt import GPT, GPTConfig
from chunkmem.packing import Packer
from chunkmem.sizing import ALIGNMENT_ELEMENTS, choose_chunk_sizes, chunks_move

ESTIMATED = [  # (layers, width, heads, world size)
    (32, 4096, 32, 64),
    (80, 8192, 64, 512),
]
ENGINE_WORLD = 4
ENGINE = {
    "full": GPTConfig(vocab_size=512, block_size=128, n_layer=8, n_head=4, n_embd=256,
                      bias=False, checkpoint=True),
    "quick": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=2, n_embd=128,
                       bias=False, checkpoint=True),
}  # fmt: skip
ENGINE_STEPS = 5
STEP_TIME = {
    "full": {"config": GPTConfig(vocab_size=8192, block_size=128, n_layer=10, n_head=10,
                                 n_embd=640, bias=False),
             "local_batch": 2, "warmup": 2, "measure": 8, "rounds": 2},
    "quick": {"config": GPTConfig(vocab_size=2048, block_size=64, n_layer=4, n_head=4,
                                  n_embd=256, bias=False),
              "local_batch": 2, "warmup": 1, "measure": 2, "rounds": 1},
}  # fmt: skip
LR = 1e-4


# ------------------------------------------------------------------ estimator rows
def estimator_rows() -> list[dict]:
    rows = []
    config = Config.from_dict({"precision": "bf16", "zero": {"stage": 3}})
    for layers, width, heads, world in ESTIMATED:
        model = ModelSettings(layers=layers, width=width, heads=heads, seq=2048, checkpointing=True)
        result = estimate(
            model, config, batch=1, world_size=world, node_size=8, device_capacity=80 << 30
        )
        memory, wire = result.memory, result.wire
        two_gathers = 2 * 2 * result.parameters * (world - 1) / world
        rows.append(
            {
                "model": result.model,
                "world_size": world,
                "steady_device_peak_bytes": memory.peak_device_bytes,
                "first_iteration_device_peak_bytes": memory.first_cycle_peak_device_bytes,
                "steady_host_bytes": memory.host_bytes,
                "first_iteration_host_bytes": memory.first_cycle_host_bytes,
                "allgather_bytes_per_step": wire.by_op.get("all_gather", 0),
                "two_gathers_bytes": two_gathers,
                "padding_fraction": memory.padding_elements
                / (memory.padding_elements + result.parameters),
            }
        )
    return rows


def ratio(first: float, steady: float) -> float:
    """first / steady, with nothing against nothing counted as equal."""
    if steady == 0:
        return 1.0 if first == 0 else math.inf
    return first / steady


# ------------------------------------------------------------------ engine rows (4 ranks)
def engine_rank(rank: int, config: GPTConfig, stages: list[int], store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=ENGINE_WORLD)  # fmt: skip
    import chunkmem

    results = {}
    for stage in stages:
        torch.manual_seed(0)
        engine = chunkmem.initialize(
            GPT(config),
            config={
                "precision": "bf16",
                "device": {"type": "simulated", "capacity": "1GiB"},
                "zero": {"stage": stage, "timeout_s": 120},
            },
        )
        generator = torch.Generator().manual_seed(3)
        for _step in range(ENGINE_STEPS):
            rows = torch.randint(0, config.vocab_size, (2 * ENGINE_WORLD, config.block_size + 1),
                                 generator=generator)[2 * rank : 2 * rank + 2]  # fmt: skip
            engine.backward(engine(rows[:, :-1], rows[:, 1:]))
            engine.step()
        ledger, comm = engine.ledger, engine.states.sharding.comm
        results[stage] = {
            "device_peaks": [ledger.peak_in("device", i) for i in range(ENGINE_STEPS)],
            "host_peaks": [ledger.peak_in("host", i) for i in range(ENGINE_STEPS)],
            "allgather_bytes": comm.ledger.bytes_sent(op="all_gather", tag=ENGINE_STEPS - 1),
            "parameters": engine.num_parameters(),
        }
        engine.close()
        gc.collect()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def engine_rows(quick: bool) -> dict:
    config = ENGINE["quick" if quick else "full"]
    with tempfile.TemporaryDirectory() as work:
        out = f"{work}/out.json"
        mp.spawn(engine_rank, args=(config, [2, 3], f"{work}/store", out), nprocs=ENGINE_WORLD)
        results = json.loads(Path(out).read_text())
    rows = {}
    for stage, result in results.items():
        device, host = result["device_peaks"], result["host_peaks"]
        steady_device, steady_host = max(device[1:]), max(host[1:])
        rows[f"zero{stage}"] = {
            **result,
            "first_vs_steady_device": ratio(device[0], steady_device),
            "first_vs_steady_host": ratio(host[0], steady_host),
            "two_gathers_bytes": 2 * 2 * result["parameters"] * (ENGINE_WORLD - 1) / ENGINE_WORLD,
        }
    rows["model"] = f"GPT {config.n_layer}x{config.n_embd}, seq {config.block_size}, bf16"
    return rows


# ------------------------------------------------------------------ padding and LoRA
def padding_rows() -> dict[str, float]:
    import transformers

    peft = _peft()

    def llama(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int):
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
            max_position_embeddings=2048,
        )  # fmt: skip
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config)

    def lora(model):
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets))

    shapes = {
        "llama-3-8b (GQA)": lambda: llama(32, 4096, 14336, 32, 8, 128256),
        "llama-2-70b (GQA)": lambda: llama(80, 8192, 28672, 64, 8, 32000),
        "lora on llama-3-8b": lambda: lora(llama(32, 4096, 14336, 32, 8, 128256)),
    }
    config = Config.from_dict({"precision": "bf16", "zero": {"stage": 3}})
    world, capacity = 8, 80 << 30
    fractions = {}
    for name, make in shapes.items():
        params = list(dict.fromkeys(make().parameters()))
        trainable = [p.numel() for p in params if p.requires_grad]
        frozen = [p.numel() for p in params if not p.requires_grad]
        alignment = math.lcm(ALIGNMENT_ELEMENTS, world)
        moving = chunks_move(config, True, capacity, torch.bfloat16, trainable, frozen)
        sizes = choose_chunk_sizes(
            config, capacity, torch.bfloat16, trainable, frozen, alignment, moving
        )
        ids = itertools.count()
        packers = {t: Packer(sizes.size(t), t, ids.__next__, alignment) for t in (1, 0)}
        for index, param in enumerate(params):
            packers[int(param.requires_grad)].place(str(index), param)
        layouts = [layout for packer in packers.values() for layout in packer.layouts]
        padding = sum(layout.padding for layout in layouts)
        fractions[name] = padding / sum(layout.capacity for layout in layouts)
    return fractions


def _peft():
    try:
        import peft
    except ImportError as error:
        raise SystemExit("benchmarks.scale needs peft (pip install -e .[test])") from error
    return peft


def lora_row() -> dict:
    import transformers

    import chunkmem

    peft = _peft()
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(config), peft.LoraConfig(r=8, target_modules=targets)
    )
    params = list(dict.fromkeys(model.parameters()))
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params) - trainable
    ideal = 16 * trainable + 4 * frozen
    engine = chunkmem.initialize(
        model, config={"device": {"type": "simulated", "capacity": "256MiB"}}
    )
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    at_end_of_backward = engine.model_state_bytes()
    engine.step()
    held = {**engine.model_state_bytes(), "grad": at_end_of_backward.get("grad", 0)}
    return {
        "trainable_parameters": trainable,
        "frozen_parameters": frozen,
        "ideal_bytes": ideal,
        "model_state_bytes": held,
        "ratio": sum(held.values()) / ideal,
    }


# ------------------------------------------------------------------ step time (2 ranks)
FRAMEWORKS = ("chunkmem_z3", "fsdp2", "deepspeed_z3")


def build(name: str, setup: dict):
    torch.manual_seed(0)
    if name == "fsdp2":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = GPT(setup["config"])
        mesh = init_device_mesh("cpu", (2,))
        for index, block in enumerate(model.blocks):
            model.blocks[index] = checkpoint_wrapper(block)
            fully_shard(model.blocks[index], mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=LR, fused=True)

        def step(x, y):
            wrapped(x, y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step
    model = GPT(replace(setup["config"], checkpoint=True))
    if name == "chunkmem_z3":
        import chunkmem

        engine = chunkmem.initialize(
            model,
            config={
                "device": {"type": "simulated", "capacity": "8GiB"},
                "optimizer": {"lr": LR, "weight_decay": 0.01},
                "zero": {"stage": 3, "timeout_s": 600},
            },
        )
        setup["chunk_size"] = engine.chunk_choice.trainable.size
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=LR, fused=True),
            config=deepspeed_config(setup, 3),
        )

    def engine_step(x, y):
        engine.backward(engine(x, y))
        engine.step()

    return engine_step


def time_rank(rank: int, setup: dict, names: list[str], store: str, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ["CHUNKMEM_BENCH_PORT"]}
    )  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    build("chunkmem_z3", setup)  # the chunk size DeepSpeed's buckets take
    gc.collect()
    times: dict[str, list[float]] = {name: [] for name in names}
    config = setup["config"]
    for round_index in range(setup["rounds"]):
        for name in names if round_index % 2 == 0 else list(reversed(names)):
            step = build(name, setup)
            for index in range(setup["warmup"] + setup["measure"]):
                generator = torch.Generator().manual_seed(1000 + index)
                rows = torch.randint(0, config.vocab_size, (4, config.block_size + 1),
                                     generator=generator)[2 * rank : 2 * rank + 2]  # fmt: skip
                dist.barrier()
                started = time.perf_counter()
                step(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())
                dist.barrier()
                if index >= setup["warmup"]:
                    times[name].append(time.perf_counter() - started)
            del step
            gc.collect()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "chunk_size": setup["chunk_size"]}))
    dist.barrier()
    dist.destroy_process_group()


def step_time_rows(quick: bool) -> dict:
    setup = STEP_TIME["quick" if quick else "full"]
    names = ["chunkmem_z3", "fsdp2"]
    if quick:
        print("--quick skips DeepSpeed (its engine takes most of the minute to build)")
    else:
        try:
            import deepspeed  # noqa: F401

            names.append("deepspeed_z3")
        except ImportError:
            print("!! DeepSpeed is not installed (pip install -e .[bench]): its row is skipped")
    os.environ.setdefault("CHUNKMEM_BENCH_PORT", "29519")
    with tempfile.TemporaryDirectory() as work:
        out = f"{work}/out.json"
        mp.spawn(time_rank, args=(setup, names, f"{work}/store", out), nprocs=2)
        result = json.loads(Path(out).read_text())
    times = result["times"]
    config = setup["config"]
    return {
        "model": f"GPT {config.n_layer}x{config.n_embd} ({config.num_parameters():,} params), "
        f"batch {setup['local_batch']}x{config.block_size} per rank, checkpointing",
        "median_step_seconds": {n: statistics.median(t) for n, t in times.items()},
        "range_step_seconds": {n: (min(t), max(t)) for n, t in times.items()},
        "all_step_seconds": times,
        "deepspeed_config": deepspeed_config({**setup, "chunk_size": result["chunk_size"]}, 3)
        if "deepspeed_z3" in times
        else None,
    }


# ------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("scale", __doc__.splitlines()[0], argv)
    estimated = estimator_rows()
    engine = engine_rows(args.quick)
    padding = {row["model"]: row["padding_fraction"] for row in estimated} | padding_rows()
    lora = lora_row()
    timing = step_time_rows(args.quick)
    median = timing["median_step_seconds"]
    ds3 = median.get("deepspeed_z3")
    first_estimated = max(
        max(
            ratio(r["first_iteration_device_peak_bytes"], r["steady_device_peak_bytes"]),
            ratio(r["first_iteration_host_bytes"], r["steady_host_bytes"]),
        )
        for r in estimated
    )
    first_measured = max(
        max(engine[s]["first_vs_steady_device"], engine[s]["first_vs_steady_host"])
        for s in ("zero2", "zero3")
    )
    metrics = {
        "first_iteration_peak_ratio_vs_steady": first_estimated,
        "measured_first_iteration_peak_ratio_vs_steady": first_measured,
        "allgather_bytes_ratio_vs_two_gathers": max(
            r["allgather_bytes_per_step"] / r["two_gathers_bytes"] for r in estimated
        ),
        "measured_allgather_bytes_ratio_vs_two_gathers": engine["zero3"]["allgather_bytes"]
        / engine["zero3"]["two_gathers_bytes"],
        "padding_fraction": max(padding.values()),
        "lora_state_bytes_ratio_vs_ideal": lora["ratio"],
        "stage3_ckpt_step_time_ratio_vs_fsdp2": median["chunkmem_z3"] / median["fsdp2"],
        "stage3_ckpt_step_time_ratio_vs_deepspeed": median["chunkmem_z3"] / ds3 if ds3 else None,
    }
    gib = 1 << 30
    print_table(
        "estimator (bf16, seq 2048, checkpointing, batch 1, 80 GiB devices, ZeRO-3)",
        [
            "model",
            "ranks",
            "steady peak GiB",
            "first GiB",
            "host steady/first GiB",
            "all-gather / 2 gathers",
            "padding",
        ],  # fmt: skip
        [
            [
                r["model"],
                r["world_size"],
                r["steady_device_peak_bytes"] / gib,
                r["first_iteration_device_peak_bytes"] / gib,
                f"{r['steady_host_bytes'] / gib:.3g} / {r['first_iteration_host_bytes'] / gib:.3g}",
                r["allgather_bytes_per_step"] / r["two_gathers_bytes"],
                r["padding_fraction"],
            ]  # fmt: skip
            for r in estimated
        ],
    )
    print_table(
        f"engine, {ENGINE_WORLD} gloo ranks, {engine['model']} (per-iteration peaks, bytes)",
        ["stage", "device peaks", "host peaks", "first/steady device", "first/steady host"],
        [
            [
                s,
                engine[s]["device_peaks"],
                engine[s]["host_peaks"],
                engine[s]["first_vs_steady_device"],
                engine[s]["first_vs_steady_host"],
            ]
            for s in ("zero2", "zero3")
        ],  # fmt: skip
    )
    print_table("padding fraction", ["shape", "padding"], [[k, v] for k, v in padding.items()])
    print_table(
        f"step time, 2 gloo ranks, {timing['model']}",
        ["framework", "median s", "range s", "vs ours"],
        [
            [
                n,
                m,
                f"{timing['range_step_seconds'][n][0]:.3g}-{timing['range_step_seconds'][n][1]:.3g}",
                m / median["chunkmem_z3"],
            ]
            for n, m in median.items()
        ],  # fmt: skip
    )
    details = {"estimator": estimated, "engine": engine, "padding": padding, "lora": lora,
               "step_time": timing}  # fmt: skip
    path = write_results(args.json, metrics, details, args.quick)
    print(f"\n{json.dumps(metrics, indent=1)}\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
