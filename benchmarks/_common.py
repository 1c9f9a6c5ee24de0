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

import torch

RESULTS = Path(__file__).parent / "results"


def parse_args(
    name: str, description: str, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description)
    parser.add_argument("--quick", action="store_true", help="a smaller run (under a minute)")
    parser.add_argument(
        "--json", type=Path, default=RESULTS / f"{name}.json", help="where to write the results"
    )
    return parser.parse_args(argv)


def environment(quick: bool) -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
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
