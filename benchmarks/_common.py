"""What every benchmark shares: the command line, the results file and a readable table."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

from benchmarks import _measured_code, staleness

REPOSITORY = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
# The CPU features that decide how fast bf16 runs: without AVX-512 BF16 or AMX, torch emulates
# bf16 arithmetic through fp32 conversions, several times slower than fp32 itself.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
# Environment variables that cap the instruction set torch and oneDNN use (to emulate an
# older CPU): a result measured under them says so.
CPU_ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def _load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _measured_code_dirty() -> bool | None:
    """Uncommitted changes to code a benchmark runs (None: not a git checkout, or no git)."""
    try:
        return bool(staleness.uncommitted_measured_changes(REPOSITORY))
    except (OSError, RuntimeError):
        return None


# Every benchmark imports this module first, so its import is when the benchmark started. The
# commit is taken here, not when the results are written: a commit made during a long run
# must not be credited with code the run loaded before it.
_STARTED = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "monotonic": time.monotonic(),
    "load_average": _load_average(),
    "commit": None,
    "dirty": None,
}


def parse_args(
    name: str, description: str, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description)
    parser.add_argument("--quick", action="store_true", help="a smaller run (under a minute)")
    parser.add_argument(
        "--json",
        type=Path,
        help=f"where to write the results (default results/{name}.json, with --quick "
        f"results/{name}.quick.json, so that a quick run never replaces a full one)",
    )
    args = parser.parse_args(argv)
    if args.json is None:
        args.json = RESULTS / f"{name}{'.quick' if args.quick else ''}.json"
    return args


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, cwd=REPOSITORY
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


_STARTED["commit"] = _git("rev-parse", "HEAD")
_STARTED["dirty"] = _measured_code_dirty()


def _changed_during_run(commit: str | None) -> bool | None:
    """Whether code a benchmark runs changed during the run: uncommitted now, or committed
    since ``commit`` (None when git cannot say)."""
    head = _git("rev-parse", "HEAD")
    if commit is None or head is None:
        return None
    if head != commit:
        moved = _git("diff", "--name-only", commit, head, "--", *staleness.MEASURED)
        if moved is None or moved:
            return True
    return _measured_code_dirty()


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what `platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: str | None = None) -> dict[str, bool] | None:
    """Which of CPU_FLAGS the CPU has, from the first `flags` line of /proc/cpuinfo (None
    where there is none, as on other systems)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return {flag: flag in present for flag in CPU_FLAGS}
    return None


def cpu_isa_overrides(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The instruction-set caps set in the environment (CPU_ISA_VARIABLES), if any."""
    return {name: env[name] for name in CPU_ISA_VARIABLES if name in env}


def environment(quick: bool) -> dict[str, Any]:
    """Where and when a result was measured: written into every results JSON.

    ``commit`` is HEAD when the run started. ``commit_dirty`` is true when code that a
    benchmark runs (the library and ``benchmarks/``, not its results) had uncommitted changes
    at the start or the end, or was committed to during the run: then the commit alone does not
    say which code ran. Edits to docs, tests or the README leave it false: they run no benchmark
    code. ``measured_code``: the repository's Python files the run loaded, its children's too
    (:mod:`benchmarks._measured_code`): what ``make bench-check`` compares.
    """
    during = _changed_during_run(_STARTED["commit"])
    flags = (_STARTED["dirty"], during)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _STARTED["commit"] or "unknown",
        "commit_dirty": True if True in flags else None if None in flags else False,
        "measured_code": _measured_code.measured_code(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": {
            "cpu": cpu_model(),
            "arch": platform.machine(),
            "logical_cores": os.cpu_count(),
            "cores_available": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total,
            "os": platform.platform(),
            "cpu_flags": cpu_flags(),
            # What torch dispatches to: lower than the flags allow under an override below.
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_isa_overrides": cpu_isa_overrides(),
        },
        "started": _STARTED["date"],
        "wall_s": round(time.monotonic() - _STARTED["monotonic"], 1),
        # Other processes' load when the benchmark started and when its results were written:
        # timings from a busy machine are not comparable with a quiet one's (byte counts are).
        "load_average_at_start_1_5_15_min": _STARTED["load_average"],
        "load_average_at_end_1_5_15_min": _load_average(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "quick": quick,
    }


def write_results(
    path: Path, metrics: dict[str, Any], details: dict[str, Any], quick: bool
) -> Path:
    """Metric keys at the top level (the names the issue asks for), the rest beside them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {**metrics, "details": details, "environment": environment(quick)}
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")
    os.replace(temporary, path)
    return path


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_format(v) for v in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
