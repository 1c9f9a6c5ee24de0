"""The overlapped host step on the split it is built for: forward and backward on a GPU, the
optimizer states in host memory and updated there (``benchmarks.gpu``'s overlap keys).

Why here and not only in ``benchmarks.offload_overlap``: on a CPU the split is emulated on two
cores that share memory bandwidth and caches, and there the compute slows beside the host's
update, which bounds what any overlap can hide below the issue's goal (that benchmark's
``update_hidden_fraction_bound``). A GPU computes from its own memory: this measures the same
keys where that bound is not in the way.

Same recipe and rules as the CPU benchmark: a GPT in bf16 with activation checkpointing,
``gradient_clipping: 1.0`` for the clipped pair, fp32 masters and Adam moments homed on the
host (``offload.optimizer: host``), two engines differing only in ``offload.overlap``, steps
of the two alternating, bit-identical parameters at the end. The regime is measured: the most
micro-batch rows (of ``block_size`` tokens) at which the serial step's host update is still
MIN_HOST_SHARE of it (``regime`` says where the candidates capped it or none reached it).
Bit-identity is checked on the parameters and buffers at the end of each pair. Timings
synchronize the device at backward's end and the step's end, so the split between
forward+backward and ``step()`` is the device's, not the launch queue's.
"""

from __future__ import annotations

import copy
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

import chunkmem
from benchmarks.offload_overlap import (
    CLIP,
    LOSS_SCALE,
    MIN_HOST_SHARE,
    ROLLBACK_EVERY,
    analyse,
    last_final_share,
    one_step,
)
from chunkmem.models.gpt import GPT, GPTConfig

FORCED_SCALE = 1e4  # a step whose loss is scaled up this much clips (a rollback)


def host_threads() -> int:
    """The host optimizer's threads: the cores but two (the engine's thread, the copies)."""
    return max(1, len(os.sched_getaffinity(0)) - 2)


def build(model: GPT, device: dict[str, Any], overlap: bool, clip: float, threads: int):
    """An engine on a copy of ``model`` with its states on the host."""
    return chunkmem.initialize(
        copy.deepcopy(model),
        config={
            "precision": "bf16",
            "device": device,
            "optimizer": {"lr": 1e-4, "weight_decay": 0.01},
            "gradient_clipping": clip,
            "offload": {"optimizer": "host", "overlap": overlap, "optimizer_threads": threads},
        },
    )


def batches(config: GPTConfig, rows: int, count: int, where: str) -> list[tuple]:
    """``count`` micro-batches of random tokens, ``rows`` x ``block_size``, on ``where``."""
    generator = torch.Generator().manual_seed(rows)
    data = torch.randint(0, config.vocab_size, (count, rows, config.block_size + 1),
                         generator=generator).to(where)  # fmt: skip
    return [(row[:, :-1], row[:, 1:]) for row in data]


def host_share(model: GPT, config: GPTConfig, device: dict, rows: int, steps: int,
               threads: int, where: str, sync: Callable[[], None]) -> float:  # fmt: skip
    """The serial engine's ``step()`` over its whole step (medians over ``steps`` after two)."""
    engine = build(model, device, False, 0.0, threads)
    try:
        samples = [
            one_step(engine, x, y, 1.0, False, sync)
            for x, y in batches(config, rows, 2 + steps, where)
        ][2:]
    finally:
        engine.close()
    return statistics.median(s.step_call_s for s in samples) / statistics.median(
        s.step_s for s in samples
    )


def choose_rows(model: GPT, config: GPTConfig, device: dict, candidates: Sequence[int],
                steps: int, threads: int, where: str,
                sync: Callable[[], None]) -> tuple[int, dict[int, float]]:  # fmt: skip
    """The most rows of ``candidates`` (fewest first) at which the host update is still
    MIN_HOST_SHARE of the serial step, and the share at each measured."""
    shares: dict[int, float] = {}
    for rows in candidates:
        shares[rows] = host_share(model, config, device, rows, steps, threads, where, sync)
        if shares[rows] < MIN_HOST_SHARE:
            break
    fitting = [rows for rows, share in shares.items() if share >= MIN_HOST_SHARE]
    return (max(fitting) if fitting else min(shares)), shares


def run_pair(model: GPT, config: GPTConfig, device: dict, rows: int, steps: int, warmup: int,
             clip: float, threads: int, where: str, sync: Callable[[], None]) -> dict:  # fmt: skip
    """The serial and overlapped engines step by step in alternating order (clipped: the loss
    scaled by LOSS_SCALE, and up every ROLLBACK_EVERY steps so that clipping fires)."""
    engines = {}
    try:
        for name, overlap in (("serial", False), ("overlapped", True)):
            engines[name] = build(model, device, overlap, clip, threads)
        samples: dict[str, list[tuple]] = {name: [] for name in engines}
        for index, (x, y) in enumerate(batches(config, rows, warmup + steps, where)):
            scale = LOSS_SCALE if clip else 1.0
            if clip and index >= warmup and index % ROLLBACK_EVERY == 0:
                scale = FORCED_SCALE
            for name in ("serial", "overlapped") if index % 2 else ("overlapped", "serial"):
                sample = one_step(engines[name], x, y, scale, False, sync)
                if index >= warmup:
                    samples[name].append(sample)
        serial, overlapped = (engines[n].state_dict() for n in ("serial", "overlapped"))
        summary = engines["overlapped"].run_summary()
        return {
            "update_hidden_fraction_dependency_bound": 1.0 - last_final_share(engines["serial"]),
            "samples": samples,
            "identical": all(torch.equal(serial[k], overlapped[k]) for k in serial),
            "commits": summary.speculative_commits,
            "rollbacks": summary.speculative_rollbacks,
        }
    finally:
        for engine in engines.values():
            engine.close()


def measure_overlap(config: GPTConfig, device: dict[str, Any], candidates: Sequence[int],
                    steps: int, warmup: int, share_steps: int,
                    sync: Callable[[], None]) -> dict[str, Any]:  # fmt: skip
    """The overlap keys at the measured regime: the plain and clipped pairs analysed as the
    CPU benchmark analyses its own (``analyse``), the regime, and bit-identity."""
    torch.manual_seed(0)
    model = GPT(config)
    where = "cuda" if device["type"] == "cuda" else "cpu"
    threads = host_threads()
    rows, shares = choose_rows(model, config, device, candidates, share_steps, threads, where,
                               sync)  # fmt: skip
    if shares[rows] < MIN_HOST_SHARE:
        regime = f"under the rule: the host update is {shares[rows]:.2f} of the step at {rows} rows"
    elif rows == max(candidates):
        regime = f"capped: the host update is still {shares[rows]:.2f} at the most rows measured"
    else:
        regime = f"the most rows at which the host update is at least {MIN_HOST_SHARE} of the step"
    runs = {name: run_pair(model, config, device, rows, steps, warmup, clip, threads, where, sync)
            for name, clip in (("plain", 0.0), ("clipped", CLIP))}  # fmt: skip
    plain, clipped = analyse(runs["plain"], 0.0), analyse(runs["clipped"], CLIP)
    for analysis in (plain, clipped):
        # Its split of the engine thread's time reads thread_time, which on a GPU counts the
        # synchronizations' spinning: not a measurement there.
        analysis.pop("unhidden_s", None)
    return {
        "update_hidden_fraction": plain["update_hidden_fraction"],
        "update_hidden_fraction_clipped": clipped["update_hidden_fraction"],
        "step_time_ratio_overlapped_vs_serial": plain["step_time_ratio"]["median"],
        "step_time_ratio_overlapped_vs_serial_clipped": clipped["step_time_ratio"]["median"],
        "rollback_step_time_ratio_vs_serial": clipped["rollback_step_time_ratio"],
        "identical": all(run["identical"] for run in runs.values()),
        "identical_by_pair": {name: run["identical"] for name, run in runs.items()},
        "rows": rows,
        "regime": regime,
        "tokens_per_step": rows * config.block_size,
        "host_update_share_by_rows": shares,
        "host_threads": threads,
        "model": config.__dict__,
        "parameters": config.num_parameters(),
        "plain": plain,
        "clipped": clipped,
        "speculation": {k: runs["clipped"][k] for k in ("commits", "rollbacks")},
    }
