"""ZeRO stages 1-3 against torch DDP, FSDP2 and DeepSpeed ZeRO 1-3 on 2 gloo ranks.

The same GPT (~54M parameters in the full run), the same data and fp32 AdamW (torch's fused
kernel everywhere it is accepted) train on two CPU ranks of this machine, one framework at a
time, in four short rounds whose order alternates forward and reversed (so a load drift, which
a long block would pin on whichever framework ran through it, hits all alike); each step is
timed between barriers and the median over all rounds is reported, with the range.

Transport and scheduling are separated: our engine moves gathers and reduce-scatters over
point-to-point rings on gloo (2-3x faster than gloo's own collectives here), FSDP2 and
DeepSpeed over gloo's own. ``chunkmem_z3_builtin`` is our stage 3 on gloo's own collectives
(``zero.transport: builtin``): its ratio to FSDP2 compares scheduling on the same transport.
DeepSpeed runs a tuned config (overlap_comm, contiguous_gradients, buckets of our chunk size),
recorded in the results.

Per-rank model-state bytes come from our ledger and are compared with the ZeRO formulas (fp32:
4 bytes each of parameter and gradient, 8 of Adam moments). Correctness at lr 1e-4: stages 1-2
sum the two ranks' gradients exactly as DDP's all-reduce does, so their parameters after the
run must equal DDP's bit for bit; stage 3 is compared with one process training on the global
batch.

DeepSpeed is a benchmark-only extra (``pip install -e .[bench]``); without it its rows are
missing and its ratio is null, said loudly.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._common import parse_args, print_table, write_results
from chunkmem.models.gpt import GPT, GPTConfig

WORLD = 2
# No biases: an attention key bias gets only rounding noise as gradient, which Adam turns into
# parameter differences of order lr per step whatever the implementation, drowning the
# comparison with single-process training in noise.
FULL = {"config": GPTConfig(vocab_size=8192, block_size=128, n_layer=10, n_head=10, n_embd=640, bias=False),
        "local_batch": 2, "warmup": 2, "measure": 5, "rounds": 4}  # fmt: skip
QUICK = {"config": GPTConfig(vocab_size=2048, block_size=64, n_layer=4, n_head=4, n_embd=256, bias=False),
         "local_batch": 2, "warmup": 1, "measure": 2, "rounds": 1}  # fmt: skip
OURS = ("chunkmem_z1", "chunkmem_z2", "chunkmem_z3")
BUILTIN = "chunkmem_z3_builtin"
DEEPSPEED = ("deepspeed_z1", "deepspeed_z2", "deepspeed_z3")
PEERS = ("ddp", "fsdp2")
LR = 1e-4  # small enough that Adam does not amplify reassociated sums past the 1e-5 check
STATE_KINDS = ("param", "grad", "grad_shard", "master", "exp_avg", "exp_avg_sq")


def batch(setup: dict, step: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch: this rank's slice, or the global batch when rank is None."""
    config = setup["config"]
    generator = torch.Generator().manual_seed(1000 + step)
    rows = torch.randint(
        0, config.vocab_size, (WORLD * setup["local_batch"], config.block_size + 1),
        generator=generator,
    )  # fmt: skip
    if rank is not None:
        rows = rows[rank * setup["local_batch"] : (rank + 1) * setup["local_batch"]]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def model_for(setup: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(setup["config"])


def build(name: str, setup: dict):
    """(step function, teardown state) for framework ``name`` on this rank."""
    model = model_for(setup)
    if name.startswith("chunkmem"):
        import chunkmem

        engine = chunkmem.initialize(
            model,
            config={
                "device": {"type": "simulated", "capacity": "8GiB"},
                "optimizer": {"lr": LR, "weight_decay": 0.01},
                "zero": {
                    "stage": int(name.split("_z")[1][0]),
                    "timeout_s": 600,
                    "transport": "builtin" if name == BUILTIN else "ring",
                },
            },
        )
        setup["chunk_size"] = engine.chunk_choice.trainable.size

        def step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            # Model states at the end of backward, where the ZeRO formulas count gradients.
            ledger = engine.ledger
            after_backward["bytes"] = sum(
                ledger.device.by_kind[k] + ledger.tiers["host"].by_kind[k] for k in STATE_KINDS
            )
            engine.step()

        after_backward: dict[str, int] = {}
        return step, (engine, after_backward)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=LR, fused=True)
    elif name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=LR, fused=True)
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=LR, fused=True),
            config=deepspeed_config(setup, int(name[-1])),
        )

        def step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()

        return step, engine

    def plain_step(x, y):
        wrapped(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return plain_step, (wrapped, optimizer)


def deepspeed_config(setup: dict, stage: int) -> dict:
    """DeepSpeed tuned as a user would: communication overlapped with backward, contiguous
    gradients, and buckets the size of our chunks (its defaults, 5e8 elements, exceed the
    whole model, so nothing would overlap)."""
    bucket = setup["chunk_size"]
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}  # fmt: skip
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=bucket, stage3_max_live_parameters=4 * bucket)
    return {
        "train_micro_batch_size_per_gpu": setup["local_batch"],
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
    }


def state_bytes(name: str, state) -> int | None:
    """Per-rank model-state bytes from our ledger (other frameworks cannot say exactly)."""
    return state[1]["bytes"] if name.startswith("chunkmem") else None


def rank_main(rank: int, setup: dict, names: list[str], store: str, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # peers' deprecated torch calls
    torch.set_num_threads(1)
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ["CHUNKMEM_BENCH_PORT"]}
    )  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    build("chunkmem_z2", setup)  # the chunk size DeepSpeed's buckets take
    gc.collect()
    times: dict[str, list[float]] = {name: [] for name in names}
    measured_bytes: dict[str, int | None] = {}
    final_states: dict[str, dict[str, torch.Tensor]] = {}
    steps = setup["warmup"] + setup["measure"]
    for round_index in range(setup["rounds"]):
        order = names if round_index % 2 == 0 else list(reversed(names))
        for name in order:
            step, state = build(name, setup)
            for index in range(steps):
                x, y = batch(setup, index, rank)
                dist.barrier()
                started = time.perf_counter()
                step(x, y)
                dist.barrier()
                if index >= setup["warmup"]:
                    times[name].append(time.perf_counter() - started)
            measured_bytes[name] = state_bytes(name, state)
            if name in OURS and round_index == 0:
                final_states[name] = state[0].state_dict()
            if name == "ddp" and round_index == 0:
                final_states[name] = {
                    k.removeprefix("module."): v.detach().clone()
                    for k, v in state[0].state_dict().items()
                }
            del step, state
            gc.collect()
    if rank == 0:
        reference = model_for(setup)
        optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, fused=True)
        for index in range(steps):
            x, y = batch(setup, index, None)
            reference(x, y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        diff = max_rel_diff(final_states["chunkmem_z3"], dict(reference.named_parameters()))
        diff_ddp = {name: max_abs_diff(final_states[name], final_states["ddp"]) for name in OURS}
        # The anchor for ``diff``: DDP against the same single process (both sum the ranks'
        # gradients, which one process adds in another order).
        ddp_diff = max_rel_diff(final_states["ddp"], dict(reference.named_parameters()))
        Path(out).write_text(
            json.dumps(
                {
                    "times": times,
                    "bytes": measured_bytes,
                    "diff": diff,
                    "diff_ddp": diff_ddp,
                    "ddp_diff": ddp_diff,
                    "torch_threads": torch.get_num_threads(),
                    "chunk_size": setup["chunk_size"],
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def max_abs_diff(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    return max(float((ours[name] - value.float()).abs().max()) for name, value in theirs.items())


def max_rel_diff(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, value in theirs.items():
        value = value.detach().float()
        worst = max(worst, float((ours[name] - value).abs().max() / value.abs().max()))
    return worst


def formula_bytes(stage: int, params: int, world: int) -> float:
    p, g, s = 4, 4, 8
    return {1: (p + g) * params + s * params / world,
            2: p * params + (g + s) * params / world,
            3: (p + g + s) * params / world}[stage]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("zero_vs_peers", __doc__.splitlines()[0], argv)
    setup = QUICK if args.quick else FULL
    names = [*OURS, BUILTIN, *PEERS]
    if args.quick:
        print("--quick skips DeepSpeed (its engines take most of a minute to build); run the")
        print("full benchmark for its rows")
    else:
        try:
            import deepspeed  # noqa: F401

            names += DEEPSPEED
        except ImportError:
            print("!! DeepSpeed is not installed (pip install -e .[bench]): its rows are skipped")
    os.environ.setdefault("CHUNKMEM_BENCH_PORT", "29517")
    with tempfile.TemporaryDirectory() as work:
        store, out = f"{work}/store", f"{work}/out.json"
        mp.spawn(rank_main, args=(setup, names, store, out), nprocs=WORLD, join=True)
        result = json.loads(Path(out).read_text())
    median = {name: statistics.median(ts) for name, ts in result["times"].items() if ts}
    spread = {name: (min(ts), max(ts)) for name, ts in result["times"].items() if ts}
    params = setup["config"].num_parameters()
    formula_ratios = {
        name: result["bytes"][name] / formula_bytes(int(name[-1]), params, WORLD) for name in OURS
    }
    ds3 = median.get("deepspeed_z3")
    metrics = {
        "stage3_step_time_ratio_vs_fsdp2": median["chunkmem_z3"] / median["fsdp2"],
        "stage3_builtin_step_time_ratio_vs_fsdp2": median[BUILTIN] / median["fsdp2"],
        "stage3_step_time_ratio_vs_deepspeed": median["chunkmem_z3"] / ds3 if ds3 else None,
        "stage2_step_time_ratio_vs_ddp": median["chunkmem_z2"] / median["ddp"],
        "model_state_bytes_ratio_vs_formula": max(formula_ratios.values()),
        "stage12_max_abs_diff_vs_ddp": max(result["diff_ddp"][n] for n in OURS[:2]),
        "param_max_rel_diff_vs_single_process": result["diff"],
    }
    rows = [
        [
            name,
            median[name],
            f"{spread[name][0]:.3g}-{spread[name][1]:.3g}",
            median[name] / median["ddp"],
            result["bytes"].get(name) or "-",
        ]
        for name in names
    ]
    if ds3 is None:
        print("!! stage3_step_time_ratio_vs_deepspeed is null: DeepSpeed did not run")
    print_table(
        f"median step seconds, GPT {setup['config'].n_layer}x{setup['config'].n_embd} "
        f"({params:,} params), 2 gloo ranks, batch {setup['local_batch']}x"
        f"{setup['config'].block_size} per rank",
        ["framework", "median s", "range s", "vs DDP", "model-state bytes/rank"],
        rows,
    )
    details = {
        "model": setup["config"].__dict__,
        "parameters": params,
        "world_size": WORLD,
        "median_step_seconds": median,
        "range_step_seconds": spread,
        "all_step_seconds": result["times"],
        "measured_steps_per_framework": setup["measure"] * setup["rounds"],
        "torch_threads_per_rank": result["torch_threads"],
        "learning_rate": LR,
        "deepspeed_config": {
            f"stage{stage}": deepspeed_config({**setup, "chunk_size": result["chunk_size"]}, stage)
            for stage in (1, 2, 3)
        },
        "model_state_bytes_per_rank": result["bytes"],
        "model_state_bytes_ratio_vs_formula_by_stage": formula_ratios,
        # Stages 1-2 sum the two ranks' gradients exactly as DDP does: bit for bit. Stage 3
        # differs from DDP only by the order of summation inside its chunks' reductions.
        "param_max_abs_diff_vs_ddp": result["diff_ddp"],
        "ddp_param_max_rel_diff_vs_single_process": result["ddp_diff"],
    }
    path = write_results(args.json, metrics, details, args.quick)
    print(f"\n{metrics}\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
