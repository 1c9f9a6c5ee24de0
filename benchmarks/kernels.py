"""Throughput of the quantization kernels: native CPU library vs the torch reference vs a plain
copy of as many bytes (`torch.clone`, the memory-bandwidth anchor), measured in one run.

    python -m benchmarks.kernels [--quick] [--json PATH]

Bytes touched = bytes read + bytes written by the op: the input elements or packed levels,
scales and offsets read, and the output elements or packed levels, scales and offsets written.
Every GB/s below is bytes touched per second. The anchor for an op clones a buffer of half its
bytes touched, so the copy touches the same number of bytes. All three allocate their outputs,
as the public API does.

[Note: page modes] Every op here writes freshly allocated memory, and on this kind of machine
(a VM) first-touch page faults on 4 KiB pages cost more than the copy itself (~1 GB/s of
written bytes vs ~20 GB/s for a warm copy). The headline numbers are therefore measured with
transparent huge pages for torch's allocations (THP_MEM_ALLOC_ENABLE=1), where `torch.clone`
measures memory bandwidth as the anchor intends; the run with default 4 KiB pages is recorded
beside them. Each mode runs in its own process, since torch reads the setting once.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "kernels.json"
PAGE_MODES = {"thp": {"THP_MEM_ALLOC_ENABLE": "1"}, "4k": {}}
REDUCE_INPUTS = 4  # devices per node in the qgZ intra-node step
GROUP_SIZE = 2048
BANDWIDTH_REPEAT_FACTOR = 4


def _measure(numel: int, repeats: int) -> dict:
    """All rows of one page mode, in this process."""
    import torch

    import kernels
    from benchmarks._timing import median_seconds
    from kernels import QuantizedTensor, reference
    from kernels.ops import _library

    native = _library("cpu")  # raises if the native library cannot be built
    rows = []

    def quantized_nbytes(q: QuantizedTensor) -> int:
        extra = 0 if q.offsets is None else q.offsets.numel() * 4
        return q.data.numel() + q.scales.numel() * 4 + extra

    def measure(
        op: str, dtype: torch.dtype, bits: int, nbytes: int, run_native, run_reference
    ) -> None:
        anchor = torch.ones((nbytes + 1) // 2, dtype=torch.uint8)
        # Native and clone take ~0.05 s each and the VM's memory bandwidth drifts from second
        # to second, so their pair gets BANDWIDTH_REPEAT_FACTOR times the samples of the
        # reference, which is seconds per call and varies far less relative to its own time.
        t = median_seconds(
            {"native": run_native, "clone": anchor.clone},
            repeats=repeats * BANDWIDTH_REPEAT_FACTOR,
        )
        t |= median_seconds({"reference": run_reference}, repeats=repeats)
        row = {
            "op": op,
            "dtype": str(dtype).removeprefix("torch."),
            "bits": bits,
            "bytes_touched": nbytes,
            **{f"{k}_s": v for k, v in t.items()},
            **{f"{k}_GBps": nbytes / v / 1e9 for k, v in t.items()},
            "ratio_vs_memcpy": t["clone"] / t["native"],
            "speedup_vs_reference": t["reference"] / t["native"],
        }
        rows.append(row)
        print(
            f"{op:<24}{row['dtype']:>9} int{bits}  native {row['native_GBps']:6.2f}  reference "
            f"{row['reference_GBps']:6.2f}  clone {row['clone_GBps']:6.2f} GB/s   ratio "
            f"{row['ratio_vs_memcpy']:.2f}  speedup {row['speedup_vs_reference']:5.1f}x",
            flush=True,
        )

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(numel, generator=gen).to(dtype)
        for bits in (8, 4):
            kw = dict(bits=bits, group_size=GROUP_SIZE, symmetric=True)
            q = kernels.quantize(x, **kw)
            measure(
                "quantize",
                dtype,
                bits,
                numel * x.element_size() + quantized_nbytes(q),
                lambda x=x, kw=kw: native.quantize(x, kw["bits"], GROUP_SIZE, True),
                lambda x=x, kw=kw: reference.quantize(x, **kw),
            )
        q = kernels.quantize(x, bits=8, group_size=GROUP_SIZE, symmetric=True)
        measure(
            "dequantize",
            dtype,
            8,
            quantized_nbytes(q) + numel * x.element_size(),
            lambda q=q, dtype=dtype: native.dequant_reduce([q], dtype),
            lambda q=q, dtype=dtype: reference.dequantize(q, out_dtype=dtype),
        )
        del x, q
    inputs = [
        kernels.quantize(
            torch.randn(numel, generator=gen), bits=8, group_size=GROUP_SIZE, symmetric=True
        )
        for _ in range(REDUCE_INPUTS)
    ]
    measure(
        f"dequant_reduce_requant/{REDUCE_INPUTS}",
        torch.float32,
        8,
        (REDUCE_INPUTS + 1) * quantized_nbytes(inputs[0]),
        lambda: native.dequant_reduce_requant(inputs),
        lambda: reference.dequant_reduce_requant(inputs),
    )

    def worst(op: str) -> float:
        return min(r["ratio_vs_memcpy"] for r in rows if r["op"].startswith(op) and r["bits"] == 8)

    return {
        "quantize_int8_ratio_vs_memcpy": worst("quantize"),
        "dequantize_int8_ratio_vs_memcpy": worst("dequantize"),
        "quant_reduce_ratio_vs_memcpy": worst("dequant_reduce_requant"),
        "native_speedup_vs_reference": min(r["speedup_vs_reference"] for r in rows),
        "threads": {
            "torch": torch.get_num_threads(),
            "native_openmp": ctypes.CDLL(str(native.path)).cmq_cpu_num_threads(),
        },
        "rows": rows,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _run_mode(mode: str, numel: int, repeats: int) -> dict:
    """Runs one page mode in a child process (torch reads the page setting at start-up)."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env.update(PAGE_MODES[mode])
    print(f"-- page mode {mode} --", flush=True)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.kernels",
            "--child",
            "--numel",
            str(numel),
            "--repeats",
            str(repeats),
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout
    lines = out.splitlines()
    print("\n".join(lines[:-1]), flush=True)
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="8M elements, 3 repeats, huge pages only"
    )
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"result file (default {DEFAULT_JSON})"
    )
    parser.add_argument(
        "--numel", type=int, help="elements per tensor (default 64M, 8M with --quick)"
    )
    parser.add_argument(
        "--repeats", type=int, help="timed runs per measurement (default 5, 3 with --quick)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    numel = args.numel or (8 << 20 if args.quick else 64 << 20)
    repeats = args.repeats or (3 if args.quick else 5)
    if args.child:
        print(json.dumps(_measure(numel, repeats)))
        return
    if args.quick:
        print(f"quick mode: {numel} elements instead of 64M, {repeats} repeats, huge pages only")
    modes = ["thp"] if args.quick else ["thp", "4k"]
    results = {mode: _run_mode(mode, numel, repeats) for mode in modes}
    headline = results["thp"]
    report = {
        key: headline[key]
        for key in (
            "quantize_int8_ratio_vs_memcpy",
            "dequantize_int8_ratio_vs_memcpy",
            "quant_reduce_ratio_vs_memcpy",
            "native_speedup_vs_reference",
        )
    }
    report.update(
        goals={"ratio_vs_memcpy": 0.8, "native_speedup_vs_reference": 5},
        definition=(
            "GB/s = (bytes read + bytes written) / median seconds; ratio_vs_memcpy = native GB/s / "
            "torch.clone GB/s on a buffer of half the bytes touched; headline ratios are the worst "
            "int8 case over fp32 and bf16, the speedup the worst over all rows"
        ),
        page_mode="thp (THP_MEM_ALLOC_ENABLE=1)",
        numel=numel,
        group_size=GROUP_SIZE,
        reduce_inputs=REDUCE_INPUTS,
        repeats=repeats,
        quick=args.quick,
        cpu=_cpu_model(),
        cpu_count=os.cpu_count(),
        threads=headline["threads"],
        torch=__import__("torch").__version__,
        rows=headline["rows"],
    )
    if "4k" in results:
        report["default_4k_pages"] = results["4k"]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps(
            {k: round(v, 3) for k, v in report.items() if k.endswith(("memcpy", "reference"))}
        )
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
