"""Gradient compression on the emulated cluster: bytes, time to loss and final loss per method.

4 gloo ranks as 2 nodes x 2 (network namespaces joined by a veth pair, `tc` rate limits, as
`benchmarks.zeropp` builds them) train the demo GPT (`chunkmem train`'s model: 4 x 128, seq 64,
8 sequences per rank) on the standard library's text at ZeRO-2, bf16 (fp32 where this CPU
emulates bf16: a calibration step decides and the JSON says why), clipping 1.0, once per
method at its paper's recommended settings, and `compression: auto`, at 1 Gbit/s and 10 Gbit/s:
`none`; `onebit` as 1-bit Adam (exact warm-up for 20% of the steps, DeepSpeed's 15-25%, then the
variance frozen); `terngrad` (clipping at 2.5 sigma); `powersgd` at rank 4 with a 10% exact
warm-up (torch's `start_powerSGD_iter`); `dgc` as Deep Gradient Compression's recipe (99.9%
sparsity in blocks of 32, momentum correction and factor masking, local clipping, the density
falling from 25% over 20% of the steps), on Adam after the same 20% exact warm-up with the
variance frozen; `auto` with the 20% warm-up (its judge times it). At
1 Gbit/s the ablations `onebit-ef-only` (no warm-up, no frozen variance) and
`powersgd-one-ring` (ZeRO-2's gather of updated shards over one ring, not in two levels: what
`zero.step_gather_two_level` is worth to the comparison with torch's hook) and
`powersgd-gather-at-step` (the step waits for that gather before it returns, not the next
forward: what `zero.overlap_step_gather`, on in every other ZeRO-2 run, is worth) run too (not
in `--quick`). So do the methods under the optimizer their papers were published with,
momentum SGD (`PAPERS_SGD`; not in `--quick`, reported, not interleaved): `none-sgd`,
`powersgd-sgd` (rank 4, the same 10% exact warm-up, and torch's hook beside it,
`ddp_powersgd_hook-sgd`: the method's cost under SGD apart from the engine's), `dgc-sgd` (the paper's recipe: momentum
correction carries the momentum, `u = m u + g`, so the optimizer's own is 0; the sparsity
warm-up, no exact one) and `onebit-sgd` (1-bit SGD: sign and block scale with error feedback
from the first step). At
1 Gbit/s torch DDP with `powerSGD_hook` (rank 4, fp32 parameters under bf16 autocast, clipping
1.0, AdamW) trains the same model on the same batches, and ZeRO-3 and host offload run once per
method (reported, not judged). The judged runs of a rate train side by side, block by block:
a block of 10 steps (3 in `--quick`) of every run before the next block of any, each block
timed alone between barriers, with anything a run left in flight waited for inside its block
(`engine.wait_for_parameters()`), and each of its steps given the block's mean time. Their
times are paired against the shared machine's drift, which made two identical runs one after
another differ by up to 11%; blocks of steps in a row, not single steps, so that what one
step hands to the next (the step's gather finishing under the next forward) counts as it does
in training.

Keys (the issue's): `wire_bytes_ratio_vs_uncompressed_<method>` (bytes rank 0 sends per
step, every collective, from the communicator's ledger), `time_to_loss_ratio_vs_uncompressed_
<method>` (at 1 Gbit/s, wall time until the 10-step moving average of the loss reaches the
uncompressed run's at its last step; compressed runs may take 50% more steps to get there; null
when they do not), `final_loss_rel_diff_vs_uncompressed_<method>` (the mean of the last 10
steps' losses against the exact run's, the median over 5 seeds, 2 in `--quick`: seed 0 is the
cluster's run, the others train in the in-process world after its exact run at seed 0 gave
the cluster's losses bit for bit; `details.seeds` has each seed's and the range),
`powersgd_time_to_loss_ratio_vs_torch_hook` (and its ablations
`powersgd_one_ring_time_to_loss_ratio_vs_torch_hook` and
`powersgd_gather_at_step_time_to_loss_ratio_vs_torch_hook`), `auto_time_ratio_vs_best_fixed_<rate>` (auto's
time to loss, its link probe at initialize included, over the best fixed choice's at that
rate, `none` included; `auto_time_ratio_vs_best_fixed` is the larger of the two) and
`auto_choice_<rate>`. Under the papers' optimizer:
`final_loss_rel_diff_vs_uncompressed_<method>_momentum_sgd` for powersgd, dgc, onebit
(medians over seeds) and torch's hook (`ddp_powersgd_hook`, the cluster's one seed: DDP needs
processes), against `none-sgd`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS, median, parse_args, print_table
from benchmarks._timing import paired_ratios
from benchmarks.zeropp import (
    PER_NODE,
    WORLD,
    Cluster,
    Run,
    Skipped,
    _text_batches,
    _torch_threads,
    engine_step_seconds,
    launch,
)

METHODS = ("none", "onebit", "terngrad", "powersgd", "dgc")
AUTO = "auto"
ABLATION = "onebit-ef-only"
ONE_RING = "powersgd-one-ring"  # ZeRO-2's step gather over one ring, not in two levels
GATHER_AT_STEP = "powersgd-gather-at-step"  # the step waits for its gather (no overlap)
WARMUP_FRACTION = {"onebit": 0.2, "powersgd": 0.1, "dgc": 0.2, AUTO: 0.2}
DGC_SPARSITY_WARMUP_FRACTION = 0.2  # of the steps, after the exact warm-up
RATES = ("1gbit", "10gbit")
TORCH_HOOK = "ddp_powersgd_hook"
MODEL = {"vocab_size": 256, "block_size": 64, "n_layer": 4, "n_embd": 128, "n_head": 2}
FULL = {"steps": 200, "extra_fraction": 0.5, "local_batch": 8, "seq": 64, "lr": 1e-3,
        "rates": ["1gbit", "10gbit"], "extras": True, "window": 10, "block": 10,
        "seeds": 5}  # fmt: skip
QUICK = {"steps": 6, "extra_fraction": 0.5, "local_batch": 8, "seq": 64, "lr": 1e-3,
         "rates": ["1gbit"], "extras": False, "window": 3, "block": 3, "seeds": 2}  # fmt: skip
SEEDED_COMPRESSORS = ("powersgd", "terngrad")  # the methods with randomness of their own
SEED_BATCH_OFFSET = 10_000  # seed s trains on the batches of steps 10,000 s on
BF16_AT_SPEED_MAX_RATIO = 2.0  # as benchmarks.zeropp's convergence
# Momentum SGD as PowerSGD, DGC and 1-bit SGD were published with; lr 0.05 was the best of
# 0.03, 0.05, 0.1, 0.3 and 1.0 on this model (docs/compression.md), weight decay the papers' 1e-4.
PAPERS_SGD = {"type": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
SGD_SUFFIX = "-sgd"
SGD_METHODS = ("powersgd", "dgc", "onebit")
FIRST_REPORT_S = 300.0  # a rank imports torch and builds its engine before its first step


# ---------------------------------------------------------------- a rank
def _worker(spec_path: str) -> None:
    """One rank: the judged runs of the spec interleaved block by block (each block of steps
    of each run in turn, so that a slow spell of the shared machine falls on all of them alike
    and their time ratios are paired), then the reported runs one after another; rank 0
    appends a line to ``progress`` after every block (the launcher's watchdog reads it)."""
    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)  # four ranks share the machine's cores
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    batches = _text_batches(spec, rank)
    progress = Path(spec["out"]) / "progress"
    results: dict[str, Any] = {}
    judged = [run for run in spec["runs"] if run.get("interleaved")]
    reported = [run for run in spec["runs"] if not run.get("interleaved")]
    if judged:
        results.update(_train_interleaved(spec, judged, batches, progress, rank))
    for run in reported:
        results.update(_train_interleaved(spec, [run], batches, progress, rank))
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _train_interleaved(
    spec: dict, runs: list[dict], batches, progress: Path, rank: int
) -> dict[str, Any]:
    """Every run's steps, block ``b`` of each run before block ``b + 1`` of any; a run that
    is done drops out. Each block is timed alone, between barriers, and what the run left in
    flight is waited for inside it; each of its steps is given the block's mean time."""
    import torch.distributed as dist

    trainers, settles = {}, {}
    engines = {}
    for run in runs:
        if run["name"].startswith(TORCH_HOOK):
            trainers[run["name"]], settles[run["name"]] = _ddp_trainer(spec, run), _nothing
        else:
            engine, trainers[run["name"]] = _engine_trainer(spec, run)
            engines[run["name"]], settles[run["name"]] = engine, engine.wait_for_parameters
    record: dict[str, dict[str, list]] = {
        run["name"]: {"step_s": [], "losses": [], "bytes_sent": []} for run in runs
    }
    block = spec["block"]
    for first in range(0, max(run["steps"] for run in runs), block):
        for run in runs:
            steps = range(first, min(first + block, run["steps"]))
            if not steps:
                continue
            name = run["name"]
            dist.barrier()
            started = time.perf_counter()
            for step in steps:
                loss, nbytes = trainers[name](*batches(step), step)
                record[name]["losses"].append(loss)
                record[name]["bytes_sent"].append(nbytes)
            settles[name]()
            dist.barrier()
            mean = (time.perf_counter() - started) / len(steps)
            record[name]["step_s"].extend([mean] * len(steps))
            if rank == 0:
                with progress.open("a") as f:
                    f.write(f"{name} steps {first}-{steps[-1]} {mean:.4f} s/step\n")
    zeros = {op: 0 for op in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")}
    results: dict[str, Any] = {}
    for run in runs:
        name = run["name"]
        steps = len(record[name]["step_s"])
        results[name] = {"rounds": [{**record[name], "cross_node_bytes": [zeros] * steps}]}
        engine = engines.get(name)
        if engine is not None and run["compression"]["type"] == AUTO:
            results[name]["auto"] = engine.run_summary().compression["auto"]
    return results


def _nothing() -> None:
    """What torch DDP leaves in flight after its step: nothing."""


def _model(seed: int = 0):
    import torch

    from chunkmem.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(**MODEL, bias=False))


def engine_config(spec: dict, run: dict, seed: int = 0) -> dict[str, Any]:
    """The engine's config for ``run``; ``seed`` reseeds the compressor's own randomness
    (PowerSGD's first Q, TernGrad's rounding)."""
    compression = dict(run["compression"])
    if seed and compression["type"] in SEEDED_COMPRESSORS:
        compression["seed"] = seed
    config: dict[str, Any] = {
        "precision": spec["precision"],
        "device": {"type": "simulated", "capacity": "8GiB"},
        "optimizer": run.get("optimizer", {"lr": spec["lr"], "weight_decay": 0.1}),
        "gradient_clipping": 1.0,
        "zero": {
            "stage": run["stage"],
            "timeout_s": 600,
            "node_size": PER_NODE,
            "step_gather_two_level": not run.get("one_ring", False),
            "overlap_step_gather": run["stage"] == 2 and not run.get("gather_at_step", False),
        },
        "compression": compression,
    }
    if run.get("offload"):
        config["offload"] = {"optimizer": "host"}
    return config


def _engine_trainer(spec: dict, run: dict):
    import chunkmem

    engine = chunkmem.initialize(_model(), config=engine_config(spec, run))
    ledger = engine.states.sharding.comm.ledger

    def step(x, y, index: int) -> tuple[float, int]:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach()), ledger.bytes_sent(tag=index)

    return engine, step


def _ddp_trainer(spec: dict, run: dict):
    """torch DDP with the PowerSGD communication hook, the recipe's counterpart: fp32
    parameters, bf16 autocast (when the run trains in bf16), clipping 1.0, AdamW (or the
    run's ``optimizer``: momentum SGD)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel

    # one bucket: the hook chains each bucket's Q all-reduce on its P all-reduce's future,
    # which completes at different moments on different ranks; with several buckets gloo
    # then gets the collectives in different orders and aborts (a mismatch of sizes)
    model = DistributedDataParallel(_model(), bucket_cap_mb=1024)
    state = powersgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=4,
        start_powerSGD_iter=max(2, spec["powersgd_warmup"]),  # the hook needs 2 at least
    )
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    settings = run.get("optimizer")
    if settings is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(
            model.parameters(),
            lr=settings["lr"],
            momentum=settings["momentum"],
            weight_decay=settings["weight_decay"],
        )

    def step(x, y, index: int) -> tuple[float, int]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec["precision"] == "bf16"):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()), 0  # the hook's bytes are not in our ledger

    return step


# ---------------------------------------------------------------- the launcher
def compression_for(method: str, steps: int) -> dict[str, Any]:
    """The method at its paper's recommended settings (the module's docstring)."""
    config: dict[str, Any] = {"type": method}
    if method in WARMUP_FRACTION:
        config["warmup_steps"] = max(3, round(WARMUP_FRACTION[method] * steps))
    if method in ("onebit", "dgc", AUTO):
        config["freeze_variance"] = True
    if method == "dgc":
        config.update(dgc_recipe(steps))
    return config


def dgc_recipe(steps: int) -> dict[str, Any]:
    """DGC's own settings: 99.9% sparsity in blocks of 32, momentum correction (with factor
    masking), the density falling from 25% over a fifth of the steps."""
    return {
        "density": 0.001,
        "block_size": 32,
        "momentum_correction": True,
        "sparsity_warmup_steps": max(1, round(DGC_SPARSITY_WARMUP_FRACTION * steps)),
    }


def papers_sgd_run(method: str, steps: int, length: int) -> dict[str, Any]:
    """``method`` under momentum SGD at its paper's settings (the module's docstring)."""
    optimizer = dict(PAPERS_SGD)
    config: dict[str, Any] = {"type": method}
    if method == "powersgd":
        config = compression_for(method, steps)
    elif method == "dgc":
        config.update(dgc_recipe(steps))
        optimizer["momentum"] = 0.0  # the correction is the momentum (u = m u + g)
    return {"name": method + SGD_SUFFIX, "compression": config, "stage": 2, "steps": length,
            "optimizer": optimizer}  # fmt: skip


def _runs(setup: dict, rate: str) -> list[dict[str, Any]]:
    steps = setup["steps"]
    longer = int(steps * (1 + setup["extra_fraction"]))

    def run(name: str, method: str, length: int, **extra: Any) -> dict[str, Any]:
        config = compression_for(method, steps)
        return {"name": name, "compression": config, "stage": 2, "steps": length, **extra}

    runs = [run("none", "none", steps)]
    runs += [run(m, m, longer) for m in (*METHODS[1:], AUTO)]
    if rate == "1gbit":
        runs.append({"name": TORCH_HOOK, "steps": longer})
        if setup["extras"]:
            runs.append({"name": ABLATION, "compression": {"type": "onebit"}, "stage": 2,
                         "steps": longer})  # fmt: skip
            runs.append(run(ONE_RING, "powersgd", longer, one_ring=True))
            runs.append(run(GATHER_AT_STEP, "powersgd", longer, gather_at_step=True))
    for judged in runs:  # the runs whose times are compared: step by step, side by side
        judged["interleaved"] = True
    if rate == "1gbit" and setup["extras"]:
        for m in METHODS:
            runs.append(run(f"{m}-zero3", m, steps, stage=3))
            runs.append(run(f"{m}-offload", m, steps, offload=True))
        runs += [papers_sgd_run(m, steps, steps if m == "none" else longer)
                 for m in ("none", *SGD_METHODS)]  # fmt: skip
        runs.append({"name": TORCH_HOOK + SGD_SUFFIX, "steps": longer, "optimizer": PAPERS_SGD})
    return runs


# ---------------------------------------------------------------- final losses over seeds
# One run's final loss is one sample: PowerSGD under momentum SGD lost 2.27% to the exact run
# at seed 0 and 0.95-1.31% at seeds 1-3 (docs/compression.md). So the final-loss keys are the
# median over seeds of each seed's loss against the exact run's at the same seed (the same
# initial model and batches). Seed s > 0 initializes the model with torch.manual_seed(s),
# reseeds the compressor's own randomness and trains on the batches of steps 10,000 s on.
def seeded_runs(setup: dict) -> list[dict[str, Any]]:
    """The runs whose final losses are keys, as the cluster trains them at 1 Gbit/s, cut to
    the judged length: the exact run and each method at ZeRO-2 under AdamW, and under momentum
    SGD (not ``auto``, whose keys are times, nor torch's hook, which needs processes)."""
    keyed = {*METHODS, ABLATION, *(m + SGD_SUFFIX for m in ("none", *SGD_METHODS))}
    runs = [run for run in _runs(setup, "1gbit") if run["name"] in keyed]
    return [{**run, "steps": setup["steps"], "interleaved": False} for run in runs]


def train_in_process(spec: dict, run: dict, seed: int, batches: Sequence) -> list[float]:
    """The losses of ``run`` at ``seed``, averaged over ranks as the cluster's launcher does
    (:func:`benchmarks.zeropp.launch`), its ranks threads of this process
    (``zero.thread_world``: the gloo ranks' bits without the cluster's namespaces and links,
    on which losses do not depend). ``batches``: each rank's batch function."""
    import chunkmem
    from zero.thread_world import ThreadWorld

    world = ThreadWorld(WORLD, timeout_s=600)

    def rank(comm) -> list[float]:
        with world.serial():  # the ranks share torch's random generator
            model = _model(seed)
        engine = chunkmem.initialize(model, comm=comm, config=engine_config(spec, run, seed))
        losses = []
        try:
            for step in range(run["steps"]):
                x, y = batches[comm.rank](SEED_BATCH_OFFSET * seed + step)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
        finally:
            engine.close()
        return losses

    per_rank = world.run(rank, deadline_s=3600)
    return [sum(step) / WORLD for step in zip(*per_rank, strict=True)]


def final_losses_over_seeds(spec: dict, setup: dict, cluster: dict[str, Any]) -> dict[str, Any]:
    """Each keyed run's final loss per seed, seed 0's the cluster's own runs (``cluster``: its
    results at 1 Gbit/s). The exact run at seed 0 is trained here too and must give the
    cluster's losses bit for bit, or the phase fails: the other seeds would then not be
    samples of the cluster's training."""
    steps, window = setup["steps"], setup["window"]
    runs = seeded_runs(setup)
    batches = [_text_batches(spec, rank) for rank in range(WORLD)]
    with _torch_threads(1):  # as each cluster rank: the same reductions, the same bits
        here = train_in_process(spec, runs[0], 0, batches)
        there = cluster[runs[0]["name"]]["rounds"][0]["losses"][:steps]
        if here != there:
            first = next(i for i, (a, b) in enumerate(zip(here, there, strict=True)) if a != b)
            raise RuntimeError(
                f"the exact run at seed 0 in the in-process world differs from the cluster's "
                f"from step {first} ({here[first]!r} against {there[first]!r}): the other "
                f"seeds would not measure the cluster's training"
            )
        final = {
            run["name"]: [final_loss(cluster[run["name"]]["rounds"][0]["losses"], steps, window)]
            for run in runs
        }
        for seed in range(1, setup["seeds"]):
            for run in runs:
                losses = train_in_process(spec, run, seed, batches)
                final[run["name"]].append(final_loss(losses, steps, window))
                print(f"seed {seed} {run['name']}: final loss {final[run['name']][-1]:.4f}")
    return {
        "seeds": list(range(setup["seeds"])),
        "batch_offset": SEED_BATCH_OFFSET,
        "exact_run_same_bits_as_cluster": True,
        "final_loss": final,
        "rel_diff": seeded_rel_diffs(final),
    }


def _final_loss_keys() -> list[tuple[str, str, str]]:
    """(key, run, the exact run it is paired with) of every final-loss key."""
    keys = [
        (f"final_loss_rel_diff_vs_uncompressed_{m}", m, "none") for m in (*METHODS[1:], ABLATION)
    ]
    exact_sgd = "none" + SGD_SUFFIX
    keys += [
        (f"final_loss_rel_diff_vs_uncompressed_{m}_momentum_sgd", m + SGD_SUFFIX, exact_sgd)
        for m in (*SGD_METHODS, TORCH_HOOK)
    ]
    return keys


def seeded_rel_diffs(final: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Per final-loss key: each seed's relative difference to the exact run of that seed, their
    median and range."""
    out: dict[str, dict[str, Any]] = {}
    for key, name, exact in _final_loss_keys():
        if name in final and exact in final:
            diffs = [(a - b) / b for a, b in zip(final[name], final[exact], strict=True)]
            out[key] = {"per_seed": diffs, "median": median(diffs), "min": min(diffs),
                        "max": max(diffs)}  # fmt: skip
    return out


def moving_average(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def time_to_loss(entry: dict, target: float, window: int) -> float | None:
    """Seconds of steps until the loss's moving average first reaches ``target`` (``auto``:
    from its link probe at initialize on)."""
    round_ = entry["rounds"][0]
    elapsed = 0.0
    if "auto" in entry:
        if entry["auto"] is None:
            raise RuntimeError(
                "compression 'auto' never decided in this run (its warm-up outlasted the "
                "steps): its time to loss has no probe time to count; run more steps"
            )
        elapsed = entry["auto"]["probe_s"]
    smoothed_losses = moving_average(round_["losses"], window)
    for seconds, smoothed in zip(round_["step_s"], smoothed_losses, strict=True):
        elapsed += seconds
        if smoothed <= target:
            return elapsed
    return None


def final_loss(losses: Sequence[float], steps: int, window: int) -> float:
    """The mean of the ``window`` losses before step ``steps`` (a longer run's later steps,
    trained for its time to loss, do not count)."""
    return sum(losses[steps - window : steps]) / window


def summarize_rate(results: dict[str, Any], setup: dict) -> dict[str, Any]:
    """Per run: median step time, bytes per step, final and target losses, time to loss."""
    window = setup["window"]
    targets = {
        base: moving_average(results[base]["rounds"][0]["losses"], window)[-1]
        for base in ("none", "none" + SGD_SUFFIX)
        if base in results
    }
    summary: dict[str, Any] = {"target_loss": targets["none"]}
    for name, entry in results.items():
        round_ = entry["rounds"][0]
        steps = setup["steps"]
        # a run under momentum SGD is timed to the exact SGD run's loss
        target = targets["none" + SGD_SUFFIX if name.endswith(SGD_SUFFIX) else "none"]
        summary[name] = {
            "step_s_median": median(round_["step_s"]),
            "bytes_sent_per_step": median(round_["bytes_sent"]),
            "final_loss": final_loss(round_["losses"], steps, window),
            "time_to_loss_s": time_to_loss(entry, target, window),
            "steps": len(round_["step_s"]),
        }
        if "auto" in entry:
            summary[name]["auto"] = entry["auto"]
    return summary


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else a / b


def metrics(details: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    slow = details.get("rates", {}).get("1gbit")
    if not slow:
        return out
    none = slow["none"]
    for method in (*METHODS[1:], ABLATION):
        ours = slow.get(method)
        if ours is None:
            continue
        out[f"wire_bytes_ratio_vs_uncompressed_{method}"] = _ratio(
            ours["bytes_sent_per_step"], none["bytes_sent_per_step"]
        )
        out[f"time_to_loss_ratio_vs_uncompressed_{method}"] = _ratio(
            ours["time_to_loss_s"], none["time_to_loss_s"]
        )
    # A key the seeds phase judges is left out where that phase did not run to its end:
    # one seed under the name of a median would be a different measurement.
    seeded = (details.get("seeds") or {}).get("rel_diff", {})
    for key, name, exact in _final_loss_keys():
        if key in seeded:
            out[key] = seeded[key]["median"]
        elif name.startswith(TORCH_HOOK) and name in slow and exact in slow:  # one seed
            out[key] = (slow[name]["final_loss"] - slow[exact]["final_loss"]) / slow[exact][
                "final_loss"
            ]
    if TORCH_HOOK in slow and "powersgd" in slow:
        out["powersgd_time_to_loss_ratio_vs_torch_hook"] = _ratio(
            slow["powersgd"]["time_to_loss_s"], slow[TORCH_HOOK]["time_to_loss_s"]
        )
    if TORCH_HOOK in slow and ONE_RING in slow:  # the ablation: the step's gather in one ring
        out["powersgd_one_ring_time_to_loss_ratio_vs_torch_hook"] = _ratio(
            slow[ONE_RING]["time_to_loss_s"], slow[TORCH_HOOK]["time_to_loss_s"]
        )
    if TORCH_HOOK in slow and GATHER_AT_STEP in slow:  # the ablation: no overlapped gather
        out["powersgd_gather_at_step_time_to_loss_ratio_vs_torch_hook"] = _ratio(
            slow[GATHER_AT_STEP]["time_to_loss_s"], slow[TORCH_HOOK]["time_to_loss_s"]
        )
    out.update(auto_metrics(details))
    return out


def auto_metrics(details: dict[str, Any]) -> dict[str, Any]:
    """Per rate: auto's time to loss over the best fixed choice's, and what it chose."""
    out: dict[str, Any] = {}
    for rate, summary in details.get("rates", {}).items():
        auto = summary.get(AUTO)
        if auto is None:
            continue
        fixed = [summary[m]["time_to_loss_s"] for m in METHODS if m in summary]
        reached = [t for t in fixed if t is not None]
        out[f"auto_choice_{rate}"] = auto["auto"]["chosen"] if auto.get("auto") else None
        out[f"auto_time_ratio_vs_best_fixed_{rate}"] = _ratio(
            auto["time_to_loss_s"], min(reached) if reached else None
        )
    ratios = [out.get(f"auto_time_ratio_vs_best_fixed_{rate}") for rate in RATES]
    if all(r is not None for r in ratios) and len(ratios) == len(RATES):
        out["auto_time_ratio_vs_best_fixed"] = max(ratios)  # type: ignore[type-var]
    return out


def _print_table(details: dict[str, Any]) -> None:
    for rate, summary in details.get("rates", {}).items():
        rows = [
            [
                name,
                s["step_s_median"],
                s["bytes_sent_per_step"],
                s["final_loss"],
                s["time_to_loss_s"],
                s["steps"],
            ]  # fmt: skip
            for name, s in summary.items()
            if name != "target_loss"
        ]
        print_table(
            f"compression at {rate} (target loss {summary['target_loss']:.4f})",
            [
                "run",
                "step s (median)",
                "bytes/step (rank 0)",
                "final loss",
                "time to loss s",
                "steps",
            ],  # fmt: skip
            rows,
        )
    seeds = details.get("seeds")
    if seeds:
        print_table(
            f"final loss against the exact run's, per seed (seeds {seeds['seeds']})",
            ["key", "median", "min", "max", "per seed"],
            [
                [key, d["median"], d["min"], d["max"], " ".join(f"{v:+.4f}" for v in d["per_seed"])]
                for key, d in seeds["rel_diff"].items()
            ],
        )


def calibrate(setup: dict) -> dict[str, Any]:
    """The precision the runs train in, chosen by a measured step: bf16 (the recipe) where this
    CPU computes it at speed, fp32 where a bf16 step takes more than ``BF16_AT_SPEED_MAX_RATIO``
    times an fp32 one (bf16 emulated: no AVX-512 BF16 or AMX). There every step would be that
    much longer, the link a smaller share of it, and the comparison would measure the CPU."""
    model = {**MODEL, "block_size": setup["seq"]}
    times = engine_step_seconds(model, ["fp32", "bf16"], setup["local_batch"], setup["seq"])
    ratio = median(paired_ratios(times["bf16"]["step_s_samples"], times["fp32"]["step_s_samples"]))
    at_speed = ratio <= BF16_AT_SPEED_MAX_RATIO
    return {
        "step_s": {p: times[p]["step_s"] for p in times},
        "bf16_over_fp32": ratio,
        "precision": "bf16" if at_speed else "fp32",
        "why_precision": None
        if at_speed
        else f"a bf16 step took {ratio:.1f}x an fp32 step here (at speed: at most "
        f"{BF16_AT_SPEED_MAX_RATIO:g}x): bf16 arithmetic is emulated on this CPU, so the runs "
        f"train in fp32",
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _worker(argv[1])
        return 0
    args = parse_args("compression", __doc__.splitlines()[0], argv)
    if args.quick and args.json == RESULTS / "compression.json":
        args.json = RESULTS / "compression.quick.json"
    setup = QUICK if args.quick else FULL
    details: dict[str, Any] = {
        "setup": {
            **setup,
            "model": MODEL,
            "methods": METHODS,
            "world": WORLD,
            "ranks_per_node": PER_NODE,
            "zero_stage": 2,
        },  # fmt: skip
        "phases": {},
        "rates": {},
    }
    run = Run(args.json, args.quick, details, summarize=metrics)
    with run.phase("calibration"):
        details["calibration"] = calibrate(setup)
    precision = details["calibration"]["precision"]
    why = Cluster.unavailable()
    slow_link: tuple[dict, dict] | None = None  # the 1 Gbit/s spec and results: seed 0
    for rate in setup["rates"]:
        with run.phase(f"emulated_{rate}"):
            if why:
                raise Skipped(why)
            spec = {"runs": _runs(setup, rate), "local_batch": setup["local_batch"],
                    "seq": setup["seq"], "lr": setup["lr"], "precision": precision,
                    "block": setup["block"],
                    "powersgd_warmup": compression_for("powersgd", setup["steps"])
                    ["warmup_steps"]}  # fmt: skip
            with Cluster() as cluster:
                cluster.limit(rate)
                results = launch(spec, cluster, FIRST_REPORT_S, module="benchmarks.compression")
            details["rates"][rate] = summarize_rate(results, setup)
            if rate == "1gbit":
                slow_link = (spec, results)
    with run.phase("seeds"):
        if slow_link is None:
            raise Skipped("the cluster's runs at 1 Gbit/s (seed 0) did not run")
        details["seeds"] = final_losses_over_seeds(slow_link[0], setup, slow_link[1])
    _print_table(details)
    print(json.dumps(metrics(details), indent=2))
    print(f"results: {args.json}")
    return 0 if run.succeeded() else 1


if __name__ == "__main__":
    sys.exit(main())
