"""Throughput of the quantization kernels against the physical limit of each op: a torch
conversion of the same shape into a preallocated buffer, moving the same bytes.

    python -m benchmarks.kernels [--quick] [--json PATH]

Every op writes into a buffer allocated once, through `out=` (as ZeRO++ does with a reused
chunk buffer), and so does every anchor; pages are the default 4 KiB ones. The anchor of an op
reads and writes what the op reads and writes (docs/benchmarks.md says why each is the right
one):

| op                            | reads        | writes       | anchor                              |
| quantize fp32/bf16 -> int8    | 4n / 2n      | n            | int8_out.copy_(x)                   |
| dequantize int8 -> fp32/bf16  | n            | 4n / 2n      | out.copy_(levels as int8)           |
| dequant_reduce_requant of 4   | 4n           | n            | int8_out.copy_(fp32 x): 4n in, n out |
| dequant_reduce of 2 -> fp32   | 2n           | 4n           | fp32_out.copy_(int16 of n)          |

(plus the scales, 1/512 of the levels at group size 2048). `ratio_vs_conversion` = anchor
seconds / native seconds, one ratio per round of interleaved samples; a key is the median over
rounds (its range beside it) and, where an op runs for fp32 and bf16, the worse of the two.
Also recorded per row: a plain copy of as many bytes (`ratio_vs_memcpy`, preallocated), the
allocating path (`native_alloc_s`: the op without `out=`, which pays first-touch page faults on
its fresh output) and the torch reference (`speedup_vs_reference`: reference seconds over the
allocating native op's in the same round, since the reference allocates too). A second
process repeats the rows with transparent huge pages for torch's allocations
(THP_MEM_ALLOC_ENABLE=1; torch reads it at start-up), without the reference.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

import kernels
from benchmarks._common import parse_args, print_table, write_results
from benchmarks._timing import paired_ratios, sample_seconds
from kernels import QuantizedTensor, reference

GROUP_SIZE = 2048
# Devices per node in the qgZ intra-node step and nodes in its inter-node step; the anchors
# of the two reduce rows are written for these counts.
REDUCE_INPUTS = 4
FINAL_REDUCE_INPUTS = 2
REFERENCE_EVERY = 4  # the reference takes seconds a call: one sample per 4 rounds
GOAL_RATIO_VS_CONVERSION = 0.9
GOAL_SPEEDUP_VS_REFERENCE = 5.0


@dataclass
class Case:
    """One row: the op through out=, its allocating form, its anchors and the reference."""

    op: str
    dtype: torch.dtype
    bits: int
    bytes_touched: int
    native: Callable[[], object]
    native_alloc: Callable[[], object]
    conversion: Callable[[], object]
    memcpy: Callable[[], object]
    reference: Callable[[], object]
    anchor: str
    anchor_same_bytes: bool = True
    # Other same-bytes torch ops worth comparing with (slower than the anchor where present).
    alternatives: dict[str, Callable[[], object]] = field(default_factory=dict)


def _quantized_nbytes(q: QuantizedTensor) -> int:
    extra = 0 if q.offsets is None else q.offsets.numel() * 4
    return q.data.numel() + q.scales.numel() * 4 + extra


def _memcpy(nbytes: int) -> Callable[[], object]:
    """A preallocated copy that reads nbytes/2 and writes nbytes/2: as many bytes touched."""
    src = torch.ones((nbytes + 1) // 2, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _cases(numel: int) -> list[Callable[[], Case]]:
    """Builders of every row; each allocates its tensors only when called."""
    gen = torch.Generator().manual_seed(0)
    kw = dict(group_size=GROUP_SIZE, symmetric=True)

    def quantize(dtype: torch.dtype, bits: int) -> Case:
        x = torch.randn(numel, generator=gen).to(dtype)
        out = kernels.quantize(x, bits=bits, **kw)
        levels = torch.empty(numel, dtype=torch.int8)
        nbytes = numel * x.element_size() + _quantized_nbytes(out)
        return Case(
            "quantize",
            dtype,
            bits,
            nbytes,
            native=lambda: kernels.quantize(x, bits=bits, **kw, backend="cpu", out=out),
            native_alloc=lambda: kernels.quantize(x, bits=bits, **kw, backend="cpu"),
            conversion=lambda: levels.copy_(x),
            memcpy=_memcpy(nbytes),
            reference=lambda: reference.quantize(x, bits=bits, **kw),
            anchor=f"int8[n].copy_({str(dtype).removeprefix('torch.')}[n])",
            # int4 writes n/2 bytes of levels; the int8 anchor writes n.
            anchor_same_bytes=bits == 8,
        )

    def dequantize(dtype: torch.dtype) -> Case:
        q = kernels.quantize(torch.randn(numel, generator=gen).to(dtype), bits=8, **kw)
        out = torch.empty(numel, dtype=dtype)
        levels = q.data.view(torch.int8)
        return Case(
            "dequantize",
            dtype,
            8,
            _quantized_nbytes(q) + numel * out.element_size(),
            native=lambda: kernels.dequantize(q, backend="cpu", out=out),
            native_alloc=lambda: kernels.dequantize(q, backend="cpu"),
            conversion=lambda: out.copy_(levels),
            memcpy=_memcpy(_quantized_nbytes(q) + numel * out.element_size()),
            reference=lambda: reference.dequantize(q, out_dtype=dtype),
            anchor=f"{str(dtype).removeprefix('torch.')}[n].copy_(int8[n])",
        )

    def inputs(count: int) -> list[QuantizedTensor]:
        return [
            kernels.quantize(torch.randn(numel, generator=gen), bits=8, **kw) for _ in range(count)
        ]

    def requant() -> Case:
        ins = inputs(REDUCE_INPUTS)
        out = kernels.quantize(torch.zeros(numel), bits=8, **kw)
        # Same bytes as the fused reduce of 4 int8 inputs: 4n read (as n fp32), n written.
        wide = torch.randn(numel, generator=gen)
        levels = torch.empty(numel, dtype=torch.int8)
        # The same-shape torch reduction: 4 int8 streams in, one int8 stream out.
        stacked = torch.stack([q.data.view(torch.int8) for q in ins])
        nbytes = (REDUCE_INPUTS + 1) * _quantized_nbytes(ins[0])
        return Case(
            f"dequant_reduce_requant/{REDUCE_INPUTS}",
            torch.float32,
            8,
            nbytes,
            native=lambda: kernels.dequant_reduce_requant(ins, backend="cpu", out=out),
            native_alloc=lambda: kernels.dequant_reduce_requant(ins, backend="cpu"),
            conversion=lambda: levels.copy_(wide),
            memcpy=_memcpy(nbytes),
            reference=lambda: reference.dequant_reduce_requant(ins),
            anchor="int8[n].copy_(fp32[n])",
            alternatives={
                "torch_sum": lambda: torch.sum(stacked, dim=0, dtype=torch.int8, out=levels)
            },
        )

    def reduce() -> Case:
        ins = inputs(FINAL_REDUCE_INPUTS)
        out = torch.empty(numel)
        # Same bytes as the final reduce of 2 int8 inputs: 2n read (as n int16), 4n written.
        narrow = torch.zeros(numel, dtype=torch.int16)
        nbytes = FINAL_REDUCE_INPUTS * _quantized_nbytes(ins[0]) + 4 * numel
        return Case(
            f"dequant_reduce/{FINAL_REDUCE_INPUTS}",
            torch.float32,
            8,
            nbytes,
            native=lambda: kernels.dequant_reduce(ins, backend="cpu", out=out),
            native_alloc=lambda: kernels.dequant_reduce(ins, backend="cpu"),
            conversion=lambda: out.copy_(narrow),
            memcpy=_memcpy(nbytes),
            reference=lambda: reference.dequant_reduce(ins),
            anchor="fp32[n].copy_(int16[n])",
        )

    return [
        lambda: quantize(torch.float32, 8),
        lambda: quantize(torch.float32, 4),
        lambda: dequantize(torch.float32),
        lambda: quantize(torch.bfloat16, 8),
        lambda: quantize(torch.bfloat16, 4),
        lambda: dequantize(torch.bfloat16),
        requant,
        reduce,
    ]


def _summary(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(numel: int, rounds: int, with_reference: bool) -> list[dict]:
    """Every row, in this process's page mode."""
    kernels.backend_for("cpu")  # build the library before timing
    rows = []
    for build in _cases(numel):
        case = build()
        fns = {
            "native": case.native,
            "conversion": case.conversion,
            "memcpy": case.memcpy,
            "native_alloc": case.native_alloc,
            **case.alternatives,
        }
        every = {}
        if with_reference:
            fns["reference"] = case.reference
            every["reference"] = REFERENCE_EVERY
        s = sample_seconds(fns, repeats=rounds, alternate=True, every=every)
        medians = {k: statistics.median(t for t in v if t is not None) for k, v in s.items()}
        row = {
            "op": case.op,
            "dtype": str(case.dtype).removeprefix("torch."),
            "bits": case.bits,
            "bytes_touched": case.bytes_touched,
            "anchor": case.anchor,
            "anchor_same_bytes": case.anchor_same_bytes,
            **{f"{k}_s": v for k, v in medians.items()},
            **{f"{k}_GBps": case.bytes_touched / v / 1e9 for k, v in medians.items()},
            "ratio_vs_conversion": _summary(paired_ratios(s["conversion"], s["native"])),
            "ratio_vs_memcpy": _summary(paired_ratios(s["memcpy"], s["native"])),
            "alloc_over_out_time": _summary(paired_ratios(s["native_alloc"], s["native"])),
            **{
                f"ratio_vs_{name}": _summary(paired_ratios(s[name], s["native"]))
                for name in case.alternatives
            },
        }
        if with_reference:
            # Like for like: the reference allocates its result (it has no in-place path), so
            # it is paired with the native op's allocating form; with out= in the details.
            row["speedup_vs_reference"] = _summary(paired_ratios(s["reference"], s["native_alloc"]))
            row["speedup_vs_reference_with_out"] = _summary(
                paired_ratios(s["reference"], s["native"])
            )
        rows.append(row)
        print(
            f"{case.op:<26}{row['dtype']:>9} int{case.bits}  native "
            f"{row['native_GBps']:6.2f}  conversion {row['conversion_GBps']:6.2f}  memcpy "
            f"{row['memcpy_GBps']:6.2f} GB/s  vs conversion "
            f"{row['ratio_vs_conversion']['median']:.2f}"
            + (
                f"  speedup {row['speedup_vs_reference']['median']:5.1f}x" if with_reference else ""
            ),
            flush=True,
        )
        del case, fns
    return rows


def _worst(rows: list[dict], op: str, key: str) -> dict[str, float]:
    """The row of `op` (int8) whose median `key` is lowest: the headline is the worse dtype."""
    matching = [r for r in rows if r["op"] == op and r["bits"] == 8]
    return min((r[key] for r in matching), key=lambda s: s["median"])


def headline(rows: list[dict]) -> dict[str, dict[str, float]]:
    keys = {
        "quantize_int8_ratio_vs_conversion": ("quantize", "ratio_vs_conversion"),
        "dequantize_int8_ratio_vs_conversion": ("dequantize", "ratio_vs_conversion"),
        "quant_reduce_ratio_vs_conversion": (
            f"dequant_reduce_requant/{REDUCE_INPUTS}",
            "ratio_vs_conversion",
        ),
        "quantize_int8_ratio_vs_memcpy": ("quantize", "ratio_vs_memcpy"),
        "dequantize_int8_ratio_vs_memcpy": ("dequantize", "ratio_vs_memcpy"),
        "quant_reduce_ratio_vs_memcpy": (
            f"dequant_reduce_requant/{REDUCE_INPUTS}",
            "ratio_vs_memcpy",
        ),
    }
    out = {name: _worst(rows, op, key) for name, (op, key) in keys.items()}
    if "speedup_vs_reference" in rows[0]:
        out["native_speedup_vs_reference"] = min(
            (r["speedup_vs_reference"] for r in rows), key=lambda s: s["median"]
        )
    return out


def _huge_page_rows(numel: int, rounds: int) -> list[dict]:
    """The rows again in a child process with huge pages for torch's allocations."""
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}
    print("-- huge pages (THP_MEM_ALLOC_ENABLE=1), separate process --", flush=True)
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels", "--child", str(numel), str(rounds)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout
    lines = out.splitlines()
    print("\n".join(lines[:-1]), flush=True)
    return json.loads(lines[-1])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        print(json.dumps(measure(int(argv[1]), int(argv[2]), with_reference=False)))
        return 0
    args = parse_args("kernels", __doc__.splitlines()[0], argv)
    numel = 8 << 20 if args.quick else 64 << 20
    rounds = 8 if args.quick else 24
    print(f"{numel:,} elements per tensor, {rounds} rounds, default 4 KiB pages", flush=True)
    rows = measure(numel, rounds, with_reference=True)
    huge = _huge_page_rows(numel, rounds // 2)
    keys = headline(rows)
    huge_keys = headline(huge)
    metrics = {
        name: round(keys[name]["median"], 4)
        for name in (
            "quantize_int8_ratio_vs_conversion",
            "dequantize_int8_ratio_vs_conversion",
            "quant_reduce_ratio_vs_conversion",
            "native_speedup_vs_reference",
        )
    }
    details = {
        "goals": {
            "ratio_vs_conversion": GOAL_RATIO_VS_CONVERSION,
            "native_speedup_vs_reference": GOAL_SPEEDUP_VS_REFERENCE,
        },
        "missed_goals": [
            name
            for name, value in metrics.items()
            if value
            < (
                GOAL_SPEEDUP_VS_REFERENCE
                if name == "native_speedup_vs_reference"
                else GOAL_RATIO_VS_CONVERSION
            )
        ],
        "definition": (
            "ratio_vs_conversion = seconds of the anchor (a same-shape torch conversion into a "
            "preallocated buffer, same bytes read and written) / seconds of the native op with "
            "out=, per round of interleaved samples; a key is the median over rounds, "
            "the worse of fp32 and bf16 where both run; ranges are min-max over rounds. "
            "GB/s = (bytes read + written) / median seconds."
        ),
        "ranges": keys,
        "page_mode": "default 4 KiB pages (THP_MEM_ALLOC_ENABLE unset)",
        "numel": numel,
        "group_size": GROUP_SIZE,
        "reduce_inputs": REDUCE_INPUTS,
        "final_reduce_inputs": FINAL_REDUCE_INPUTS,
        "rounds": rounds,
        "reference_every": REFERENCE_EVERY,
        "threads": {
            "torch": torch.get_num_threads(),
            "native_openmp": ctypes.CDLL(
                str(kernels.ops._library("cpu").path)
            ).cmq_cpu_num_threads(),
        },
        "rows": rows,
        "huge_pages": {"keys": huge_keys, "rows": huge},
    }
    print_table(
        "native with out= vs its anchor, default 4 KiB pages (GB/s of bytes read + written)",
        ["op", "dtype", "bits", "native", "anchor", "memcpy", "alloc", "vs anchor", "range"],
        [
            [
                r["op"],
                r["dtype"],
                r["bits"],
                r["native_GBps"],
                r["conversion_GBps"],
                r["memcpy_GBps"],
                r["native_alloc_GBps"],
                r["ratio_vs_conversion"]["median"],
                f"{r['ratio_vs_conversion']['min']:.2f}-{r['ratio_vs_conversion']['max']:.2f}",
            ]
            for r in rows
        ],
    )
    path = write_results(args.json, metrics, details, args.quick)
    print(f"\n{json.dumps(metrics)}\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
