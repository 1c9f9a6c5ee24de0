"""GPU throughput: the quantization kernels against a same-shape conversion and a copy, the
chunk moves against a pinned copy_, and the engine's step time against plain PyTorch.

    python -m benchmarks.gpu [--quick] [--json PATH]

Needs a CUDA device. Without one it says so and still writes the results file, every key null
and ``not_measured`` giving the reason, and exits 0.

- Kernels (fp32 and bf16 input, int8, symmetric, group 2048): GB/s = (bytes read + bytes
  written) / median time, CUDA events around each call, calls round-robin with their anchors.
  The conversion anchor of an op reads and writes the same bytes in one torch elementwise
  kernel: quantize x -> ``x.to(torch.int8)``; dequantize -> ``q.data.to(dtype)``; the fused
  reduce of 4 int8 inputs -> a buffer of their bytes viewed as int32 converted to uint8 (4N
  bytes in, N out). The copy anchor is ``copy_`` of half the bytes touched.
  ``gpu_quant_ratio_vs_conversion`` is the worst op's conversion time / kernel time.
- Moves: a chunk copied by ``CudaDevice.to_device`` (side stream, event, compute stream waits)
  and ``to_host``, the path every chunk move of the engine takes, timed with events on the
  compute stream from before the call to after the wait, against ``copy_(non_blocking=True)``
  between the same pinned host buffer and a preallocated device buffer on the compute stream.
  ``h2d_move_ratio_vs_pinned_copy`` = pinned copy time / move time, host to device.
- Step: a GPT (fp32) whose chunks all fit, chunkmem on the CUDA device against plain PyTorch
  with ``AdamW(fused=True)`` on the same GPU, one step of each in turn, median seconds (each
  step ends reading its loss). ``gpu_step_time_ratio_vs_torch`` = chunkmem / torch.
- Overlap (``benchmarks/_gpu_overlap.py``): the offloaded host step overlapped with backward
  against the serial one, on the split it is built for (the GPU computes, the host updates),
  GPT-2 small's shape in bf16 with activation checkpointing, at the most micro-batch rows at
  which the host update is still 30% of the serial step. ``gpu_update_hidden_fraction`` and
  ``gpu_update_hidden_fraction_clipped`` (clip 1.0, the steps where it did not fire) are the
  shares of the serial update hidden, ``gpu_step_time_ratio_overlapped_vs_serial_clipped`` the
  clipped step-time ratio; each pair's parameters bit-identical to the serial engine's at
  its end (else the benchmark exits 1).
"""

from __future__ import annotations

import copy
import itertools
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from benchmarks._common import parse_args, print_table, write_results

KEYS = (
    "gpu_quant_ratio_vs_conversion",
    "h2d_move_ratio_vs_pinned_copy",
    "gpu_step_time_ratio_vs_torch",
)
OVERLAP_KEYS = (  # benchmarks/_gpu_overlap.py's keys, prefixed
    "gpu_update_hidden_fraction",
    "gpu_update_hidden_fraction_clipped",
    "gpu_step_time_ratio_overlapped_vs_serial_clipped",
)
GOALS = {
    "gpu_quant_ratio_vs_conversion": ">= 0.8",
    "h2d_move_ratio_vs_pinned_copy": ">= 0.8",
    "gpu_step_time_ratio_vs_torch": "<= 1.10",
    "gpu_update_hidden_fraction": ">= 0.80",
    "gpu_update_hidden_fraction_clipped": ">= 0.80",
    "gpu_step_time_ratio_overlapped_vs_serial_clipped": "<= 0.80",
}
GROUP_SIZE = 2048
REDUCE_INPUTS = 4


def event_medians_ms(
    fns: Mapping[str, Callable[[], object]], *, repeats: int, warmup: int = 2
) -> dict[str, float]:
    """Median milliseconds of each callable, timed with CUDA events on the current stream,
    round-robin after ``warmup`` untimed rounds."""
    stream = torch.cuda.current_stream()
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            result = fn()
            end.record(stream)
            end.synchronize()
            samples[name].append(start.elapsed_time(end))
            del result
    return {name: statistics.median(times) for name, times in samples.items()}


def measure_kernels(numel: int, repeats: int) -> list[dict[str, Any]]:
    import kernels

    def nbytes(q: kernels.QuantizedTensor) -> int:
        extra = 0 if q.offsets is None else q.offsets.numel() * 4
        return q.data.numel() + q.scales.numel() * 4 + extra

    rows = []

    def row(op: str, dtype: torch.dtype, touched: int, kernel, conversion) -> None:
        copy_src = torch.empty(touched // 2, dtype=torch.uint8, device="cuda")
        copy_dst = torch.empty_like(copy_src)
        ms = event_medians_ms(
            {"kernel": kernel, "conversion": conversion, "copy": lambda: copy_dst.copy_(copy_src)},
            repeats=repeats,
        )
        rows.append(
            {
                "op": op,
                "dtype": str(dtype).removeprefix("torch."),
                "bytes_touched": touched,
                **{f"{k}_ms": v for k, v in ms.items()},
                **{f"{k}_GBps": touched / (v / 1e3) / 1e9 for k, v in ms.items()},
                "ratio_vs_conversion": ms["conversion"] / ms["kernel"],
                "ratio_vs_copy": ms["copy"] / ms["kernel"],
            }
        )

    kw = dict(bits=8, group_size=GROUP_SIZE, symmetric=True, backend="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(numel, device="cuda").to(dtype)
        q = kernels.quantize(x, **kw)
        row(
            "quantize",
            dtype,
            x.numel() * x.element_size() + nbytes(q),
            lambda x=x: kernels.quantize(x, **kw),
            lambda x=x: x.to(torch.int8),
        )
        row(
            "dequantize",
            dtype,
            nbytes(q) + numel * x.element_size(),
            lambda q=q, dtype=dtype: kernels.dequantize(q, out_dtype=dtype, backend="cuda"),
            lambda q=q, dtype=dtype: q.data.to(dtype),
        )
        del x, q
    inputs = [kernels.quantize(torch.randn(numel, device="cuda"), **kw) for _ in range(4)]
    packed = torch.empty(REDUCE_INPUTS * numel, dtype=torch.uint8, device="cuda")
    row(
        f"dequant_reduce_requant/{REDUCE_INPUTS}",
        torch.float32,
        (REDUCE_INPUTS + 1) * nbytes(inputs[0]),
        lambda: kernels.dequant_reduce_requant(inputs, backend="cuda"),
        lambda: packed.view(torch.int32).to(torch.uint8),
    )
    return rows


def measure_moves(nbytes: int, repeats: int) -> list[dict[str, Any]]:
    from chunkmem.devices import CudaDevice

    device = CudaDevice()
    numel = nbytes // 4
    host = device.host_empty(numel, torch.float32)
    host.copy_(torch.randn(numel))
    on_device = torch.empty(numel, device="cuda")
    host_target = device.host_empty(numel, torch.float32)
    assert host.is_pinned() and host_target.is_pinned()

    def move_down() -> torch.Tensor:
        buffer, event = device.to_device(host)
        device.wait(event)
        return buffer

    def move_up() -> None:
        device.wait(device.to_host(on_device, host_target))

    ms = event_medians_ms(
        {
            "h2d_move": move_down,
            "h2d_pinned_copy": lambda: on_device.copy_(host, non_blocking=True),
            "d2h_move": move_up,
            "d2h_pinned_copy": lambda: host_target.copy_(on_device, non_blocking=True),
        },
        repeats=repeats,
    )
    return [
        {
            "direction": direction,
            "bytes": numel * 4,
            "move_ms": ms[f"{direction}_move"],
            "pinned_copy_ms": ms[f"{direction}_pinned_copy"],
            "move_GBps": numel * 4 / (ms[f"{direction}_move"] / 1e3) / 1e9,
            "pinned_copy_GBps": numel * 4 / (ms[f"{direction}_pinned_copy"] / 1e3) / 1e9,
            "ratio_vs_pinned_copy": ms[f"{direction}_pinned_copy"] / ms[f"{direction}_move"],
        }
        for direction in ("h2d", "d2h")
    ]


def measure_step(quick: bool) -> dict[str, Any]:
    import chunkmem
    from benchmarks._timing import median_seconds
    from chunkmem.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    # GPT-2 small's shape: on a small model the GPU finishes a step in the time Python takes
    # to issue it, and the ratio would measure hook overhead alone.
    block_size, rounds = (256, 8) if quick else (512, 25)
    config = GPTConfig(
        vocab_size=8192, block_size=block_size, n_layer=12, n_head=12, n_embd=768
    )  # fmt: skip
    batch = 8
    model = GPT(config)
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(
        0, config.vocab_size, (16, batch, config.block_size + 1), generator=generator
    ).cuda()
    stream = {name: itertools.cycle(data) for name in ("chunkmem", "torch")}
    engine = chunkmem.initialize(
        copy.deepcopy(model),
        config={
            "device": {"type": "cuda", "capacity": 64 * config.num_parameters() + 2**31},
            "optimizer": {"lr": 1e-4, "weight_decay": 0.01},
        },
    )
    plain = copy.deepcopy(model).cuda()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    def ours() -> None:
        row = next(stream["chunkmem"])
        loss = engine(row[:, :-1], row[:, 1:])
        engine.backward(loss)
        engine.step()
        float(loss.detach())

    def torch_step() -> None:
        row = next(stream["torch"])
        loss = plain(row[:, :-1], row[:, 1:])
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        float(loss.detach())

    # Warm-up rounds: chunkmem records its trace and homes its optimizer states in these.
    seconds = median_seconds({"chunkmem": ours, "torch": torch_step}, repeats=rounds, warmup=3)
    return {
        "model": config.__dict__,
        "parameters": config.num_parameters(),
        "batch": batch,
        "rounds": rounds,
        "median_step_seconds": seconds,
        "ratio": seconds["chunkmem"] / seconds["torch"],
        "bytes_moved_last_iteration": engine.ledger.bytes_moved(engine.ledger.iteration - 1),
        "optimizer_states_on_device": all(home.compute for home in engine.states.homes.values()),
    }


def measure_gpu_overlap(quick: bool) -> dict[str, Any]:
    """The overlap keys on this GPU (``benchmarks/_gpu_overlap.py``): GPT-2 small's shape with
    activation checkpointing, micro-batches of 4 rows and up."""
    from benchmarks._gpu_overlap import measure_overlap
    from chunkmem.models.gpt import GPTConfig

    config = GPTConfig(vocab_size=8192, block_size=256 if quick else 512, n_layer=12,
                       n_head=12, n_embd=768, checkpoint=True)  # fmt: skip
    device = {"type": "cuda", "capacity": 64 * config.num_parameters() + 2**35}  # activations
    candidates = (4, 8, 16, 32, 64) if quick else (4, 8, 16, 32, 64, 128, 256)
    steps, warmup, share_steps = (12, 3, 2) if quick else (48, 6, 4)
    return measure_overlap(config, device, candidates, steps, warmup, share_steps,
                           torch.cuda.synchronize)  # fmt: skip


def print_overlap(overlap: dict[str, Any], card: str) -> None:
    """The overlap's table (``measure_gpu_overlap``'s result)."""
    print_table(
        f"offloaded step overlapped vs serial, GPT {overlap['model']['n_layer']}x"
        f"{overlap['model']['n_embd']} bf16, {overlap['rows']}x{overlap['model']['block_size']} "
        f"tokens (host update {overlap['host_update_share_by_rows'][overlap['rows']]:.0%} of the "
        f"serial step), {overlap['host_threads']} host threads ({card})",
        ["run", "serial ms", "overlapped ms", "hidden", "of at most", "ratio"],
        [
            [
                name,
                1e3 * r["median_step_s"]["serial"],
                1e3 * r["median_step_s"]["overlapped"],
                r["update_hidden_fraction"],
                r["update_hidden_fraction_dependency_bound"],
                r["step_time_ratio"]["median"],
            ]
            for name, r in (("plain", overlap["plain"]), ("clip 1.0", overlap["clipped"]))
            if r["median_step_s"]
        ],  # fmt: skip
    )
    print(f"regime: {overlap['regime']}; bit-identical to the serial engine: "
          f"{overlap['identical_by_pair']}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("gpu", __doc__.splitlines()[0], argv)
    if not torch.cuda.is_available():
        reason = f"no CUDA device: torch {torch.__version__} sees none on this machine"
        print(f"benchmarks.gpu: {reason}; writing null results")
        metrics: dict[str, Any] = {key: None for key in (*KEYS, *OVERLAP_KEYS)}
        metrics["not_measured"] = reason
        path = write_results(args.json, metrics, {"goals": GOALS}, args.quick)
        print(f"written to {path}")
        return 0

    numel = (16 << 20) if args.quick else (64 << 20)
    chunk_bytes = (64 << 20) if args.quick else (256 << 20)
    repeats = 10 if args.quick else 30
    card = torch.cuda.get_device_name()
    print(f"{card}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)

    kernel_rows = measure_kernels(numel, repeats)
    print_table(
        f"quantization kernels, {numel:,} elements, int8 symmetric, group {GROUP_SIZE} ({card})",
        ["op", "dtype", "kernel GB/s", "conversion GB/s", "copy GB/s", "vs conversion", "vs copy"],
        [
            [
                r["op"],
                r["dtype"],
                r["kernel_GBps"],
                r["conversion_GBps"],
                r["copy_GBps"],
                r["ratio_vs_conversion"],
                r["ratio_vs_copy"],
            ]
            for r in kernel_rows
        ],
    )
    move_rows = measure_moves(chunk_bytes, repeats)
    print_table(
        f"chunk moves of {chunk_bytes >> 20} MiB, CudaDevice against pinned copy_ ({card})",
        ["direction", "move GB/s", "pinned copy_ GB/s", "ratio"],
        [
            [r["direction"], r["move_GBps"], r["pinned_copy_GBps"], r["ratio_vs_pinned_copy"]]
            for r in move_rows
        ],
    )
    step = measure_step(args.quick)
    print_table(
        f"step time, GPT {step['model']['n_layer']}x{step['model']['n_embd']} "
        f"({step['parameters']:,} params, fp32), batch {step['batch']}x"
        f"{step['model']['block_size']}, everything on the device ({card})",
        ["run", "median s", "ratio vs torch"],
        [
            [name, s, s / step["median_step_seconds"]["torch"]]
            for name, s in step["median_step_seconds"].items()
        ],
    )

    metrics = {
        "gpu_quant_ratio_vs_conversion": min(r["ratio_vs_conversion"] for r in kernel_rows),
        "h2d_move_ratio_vs_pinned_copy": next(
            r["ratio_vs_pinned_copy"] for r in move_rows if r["direction"] == "h2d"
        ),
        "gpu_step_time_ratio_vs_torch": step["ratio"],
        **{key: None for key in OVERLAP_KEYS},
    }
    details = {
        "card": card,
        "goals": GOALS,
        "numel": numel,
        "group_size": GROUP_SIZE,
        "repeats": repeats,
        "kernels": kernel_rows,
        "moves": move_rows,
        "d2h_move_ratio_vs_pinned_copy": next(
            r["ratio_vs_pinned_copy"] for r in move_rows if r["direction"] == "d2h"
        ),
        "step": step,
        "overlap": "not finished: the run stopped while the overlap was measured",
    }
    # Written now and again after the overlap (the longest part), so that a run stopped by a
    # time limit there keeps the other keys.
    write_results(args.json, metrics, details, args.quick)
    overlap = measure_gpu_overlap(args.quick)
    metrics.update({key: overlap[key.removeprefix("gpu_")] for key in OVERLAP_KEYS})
    details["overlap"] = overlap
    path = write_results(args.json, metrics, details, args.quick)
    print_overlap(overlap, card)
    print(f"\n{metrics}\nwritten to {path}")
    return 0 if overlap["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
