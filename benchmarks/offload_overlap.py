"""Offload step overlapped with backward against the serial step, same model, same run.

    python -m benchmarks.offload_overlap [--quick] [--json PATH]

A GPT-style model trains in bf16 with its fp32 masters and Adam moments on the host
(``offload.optimizer: host``), where the native host optimizer updates them. Two engines
on the same model and data differ only in ``offload.overlap``: the serial one updates every
chunk group in ``engine.step()``, after backward; the overlapped one starts a group's update
on a host thread as soon as its gradients are final, while backward goes on.

[Note: emulating a GPU and its host on a CPU] Without a GPU the split is emulated: the model's
forward and backward run on core 0 (torch threads = 1, the main thread pinned there), as a GPU
would run them, and the host optimizer runs with 1 thread on core 1, as the host would. The
serial engine's ``step()`` moves the main thread to core 1 for the update and back, so both
engines update on the same core with the same thread count. What the emulation cannot
separate: the two cores share this machine's memory bandwidth and caches, which a GPU and its
host do not, so the overlapped compute slows down somewhat while the host updates (the
backward time is reported for both engines). The chunk size is the engine's automatic choice.

The sizes put the host step near the backward time, the regime offload is for (users report
host steps several times the compute: DeepSpeed issue #6834). Each step runs on both engines
back to back, in alternating order. The steps are cut into blocks of BLOCK pairs; a block's
ratio is the overlapped engine's median step time over the serial one's (a median is steadier
than single ~100 ms steps on a shared machine), and the median, quartiles and range over
blocks are reported. Both engines must end bit-identical.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Sequence

import torch

import chunkmem
from benchmarks._common import parse_args, print_table, write_results
from chunkmem.models.gpt import GPT, GPTConfig

COMPUTE_CORE, HOST_CORE = 0, 1
BLOCK = 8  # step pairs per ratio


def quartiles(values: Sequence[float]) -> dict[str, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": q2, "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def build(model: torch.nn.Module, overlap: bool, pinned: bool) -> chunkmem.Engine:
    engine = chunkmem.initialize(
        copy.deepcopy(model),
        config={
            "precision": "bf16",
            "device": {"type": "simulated", "capacity": "4GiB"},
            "optimizer": {"lr": 1e-4},
            "offload": {"optimizer": "host", "overlap": overlap, "optimizer_threads": 1},
        },
    )
    if overlap and pinned:
        engine.reducer.listener.run_on_host_thread(
            lambda: os.sched_setaffinity(0, {HOST_CORE})
        ).result()
    return engine


def one_step(engine: chunkmem.Engine, row: torch.Tensor, serial_on_host_core: bool) -> tuple:
    """(step seconds, forward+backward seconds, engine.step() seconds)."""
    start = time.perf_counter()
    engine.backward(engine(row[:, :-1], row[:, 1:]))
    backward_done = time.perf_counter()
    if serial_on_host_core:
        os.sched_setaffinity(0, {HOST_CORE})
    engine.step()
    if serial_on_host_core:
        os.sched_setaffinity(0, {COMPUTE_CORE})
    end = time.perf_counter()
    return end - start, backward_done - start, end - backward_done


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("offload_overlap", __doc__.splitlines()[0], argv)
    layers, width, seq, steps = (4, 512, 16, 36) if args.quick else (4, 512, 16, 124)
    warmup = 4
    pinned = len(os.sched_getaffinity(0)) >= 2
    torch.set_num_threads(1)
    if pinned:
        os.sched_setaffinity(0, {COMPUTE_CORE})
    config = GPTConfig(vocab_size=512, block_size=seq, n_layer=layers, n_head=4, n_embd=width)
    torch.manual_seed(0)
    model = GPT(config)
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 512, (1, seq + 1), generator=generator) for _ in range(steps)]
    engines = {"serial": build(model, False, pinned), "overlapped": build(model, True, pinned)}
    times: dict[str, list[tuple]] = {name: [] for name in engines}
    for index, row in enumerate(rows):
        order = ("serial", "overlapped") if index % 2 else ("overlapped", "serial")
        for name in order:
            sample = one_step(engines[name], row, pinned and name == "serial")
            if index >= warmup:
                times[name].append(sample)
    serial, overlapped = engines["serial"].state_dict(), engines["overlapped"].state_dict()
    identical = all(torch.equal(serial[k], overlapped[k]) for k in serial)
    pairs = list(zip(times["overlapped"], times["serial"], strict=True))
    ratios = [
        statistics.median(o[0] for o, _s in block) / statistics.median(s[0] for _o, s in block)
        for block in (pairs[i : i + BLOCK] for i in range(0, len(pairs) - BLOCK + 1, BLOCK))
    ]
    ratio = quartiles(ratios)
    summary = {
        name: {
            part: quartiles([sample[i] for sample in samples])
            for i, part in enumerate(("step_s", "forward_backward_s", "engine_step_s"))
        }
        for name, samples in times.items()
    }
    serial_step = summary["serial"]["step_s"]["median"]
    bound = summary["serial"]["forward_backward_s"]["median"] / serial_step
    listener = engines["overlapped"].reducer.listener
    print(
        f"GPT {layers}x{width}, {config.num_parameters():,} parameters, bf16, batch 1 x {seq} "
        f"tokens; fp32 masters and Adam moments on the host, native host optimizer, 1 thread."
    )
    print(
        "Emulated GPU/host split: "
        + (
            f"compute on core {COMPUTE_CORE} (torch threads = 1), host optimizer on core "
            f"{HOST_CORE}; the serial step() also runs on core {HOST_CORE}."
            if pinned
            else "NOT pinned (fewer than 2 cores available): the ratio is not meaningful."
        )
    )
    print_table(
        f"{len(pairs)} step pairs after {warmup} warm-up steps (median, range)",
        ["engine", "step ms", "min", "max", "fwd+bwd ms", "engine.step() ms"],
        [
            [
                name,
                1e3 * s["step_s"]["median"],
                1e3 * s["step_s"]["min"],
                1e3 * s["step_s"]["max"],
                1e3 * s["forward_backward_s"]["median"],
                1e3 * s["engine_step_s"]["median"],
            ]
            for name, s in summary.items()
        ],
    )
    print(
        f"\nstep_time_ratio_overlapped_vs_serial: {ratio['median']:.3f} over {len(ratios)} blocks "
        f"of {BLOCK} step pairs (quartiles {ratio['q1']:.3f}-{ratio['q3']:.3f}, range "
        f"{ratio['min']:.3f}-{ratio['max']:.3f}; "
        f"goal <= 0.8). The serial backward's share of the step, {bound:.3f}, is where a fully "
        f"hidden update would land. Updates started in backward: {listener.started}. "
        f"Parameters bit-identical: {identical}."
    )
    metrics = {"step_time_ratio_overlapped_vs_serial": ratio["median"]}
    details = {
        "model": {
            "layers": layers,
            "width": width,
            "tokens_per_step": seq,
            "parameters": config.num_parameters(),
            "precision": "bf16",
            "chunk_groups": len(engines["overlapped"].params.trainable_layouts()),
        },
        "emulation": {
            "pinned": pinned,
            "compute_core": COMPUTE_CORE,
            "host_core": HOST_CORE,
            "torch_threads": 1,
            "optimizer_threads": 1,
        },
        "step_time_ratio_overlapped_vs_serial": ratio,
        "block_ratios": ratios,
        "step_pairs_per_block": BLOCK,
        "fully_hidden_update_bound": bound,
        "engines": summary,
        "updates_started_in_backward": listener.started,
        "parameters_bit_identical": identical,
        "load_average": os.getloadavg(),
    }
    write_results(args.json, metrics, details, args.quick)
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
