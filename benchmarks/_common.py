"""What every benchmark shares: the command line, the results file and a readable table."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

RESULTS = Path(__file__).parent / "results"


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
            ["git", *args], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what `platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(quick: bool) -> dict[str, Any]:
    """Where and when a result was measured: written into every results JSON.

    `commit_dirty` is true when the work tree had uncommitted changes to tracked files other
    than the results themselves, so the commit alone does not say which code ran.
    """
    status = _git(
        "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
        ":(top,exclude)benchmarks/results",
    )  # fmt: skip
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD") or "unknown",
        "commit_dirty": None if status is None else bool(status),
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
        },
        # Other processes' load when the results were written: timings from a busy machine
        # are not comparable with a quiet one's (byte counts are).
        "load_average_1_5_15_min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
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
