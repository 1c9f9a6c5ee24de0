"""``chunkmem report RUN_DIR``: re-render a run's memory-trace pages, print its headline.

Every ``memory_trace.json`` under RUN_DIR (one per rank) is rendered again into its HTML
page and a PNG summary beside it (``chunkmem.report.png``), and its headline numbers are
printed, with the loss and throughput of the run's ``metrics.jsonl`` when ``chunkmem train``
wrote one (docs/cli.md).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from chunkmem.cli.exit_codes import ExitCode
from chunkmem.errors import ConfigError
from chunkmem.report import headline, read_memory_trace, rerender_html
from chunkmem.report.png import write_png

TRACE = "memory_trace.json"


def run_report(run_dir: Path, as_json: bool) -> int:
    if not run_dir.exists():
        raise ConfigError(f"run directory {str(run_dir)!r} does not exist")
    traces = sorted(run_dir.rglob(TRACE)) if run_dir.is_dir() else [run_dir]
    if not traces:
        raise ConfigError(
            f"no {TRACE} under {str(run_dir)!r}: a run writes one into OUT/report at its end "
            f"(chunkmem train), or engine.write_report(dir) does"
        )
    reports = []
    for trace in traces:
        document = read_memory_trace(trace)
        html = rerender_html(trace)
        png = write_png(document, trace.with_suffix(".png"))
        reports.append(
            {"trace": str(trace), "html": str(html), "png": str(png), **headline(document)}
        )
    metrics = training_metrics(run_dir / "metrics.jsonl") if run_dir.is_dir() else None
    if as_json:
        print(json.dumps({"reports": reports, "training": metrics}, indent=1))
    else:
        print(render(reports, metrics))
    return int(ExitCode.OK)


def training_metrics(path: Path) -> dict[str, Any] | None:
    """The last step's loss and the run's median throughput, from ``metrics.jsonl``."""
    if not path.is_file():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        return None
    return {
        "steps": lines[-1]["step"],
        "last_loss": lines[-1]["loss"],
        "median_tokens_per_s": statistics.median(line["tokens_per_s"] for line in lines),
    }


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "unlimited"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def render(reports: list[dict[str, Any]], metrics: dict[str, Any] | None) -> str:
    lines = []
    for report in reports:
        tiers = "; ".join(
            f"{name} peak {_size(tier['peak_bytes'])}"
            + (
                f" of {_size(tier['capacity_bytes'])} "
                f"({tier['peak_bytes'] / tier['capacity_bytes']:.1%})"
                if tier["capacity_bytes"]
                else ""
            )
            for name, tier in report["tiers"].items()
        )
        kinds = ", ".join(
            f"{kind} {_size(n)}" for kind, n in report["model_state_bytes_by_kind"].items() if n
        )
        homes = report["optimizer_state_homes"]
        lines += [
            f"{report['trace']}: {report['device_kind']} device, {report['precision']}, "
            f"{report['global_steps']:,} optimizer steps ({report['skipped_steps']} skipped)",
            f"  {tiers}",
            f"  model states {_size(report['model_state_bytes'])} ({kinds}); padding "
            f"{_size(report['padding_bytes'])}; {report['layouts']} layouts of "
            f"{report['chunk_size_elements']:,} elements",
            f"  bytes moved between tiers: {_size(report['bytes_moved_recorded'])} over "
            f"{report['iterations_with_moves_recorded']} iterations with moves"
            + (
                f" (the last, iteration {report['last_iteration_with_moves']}: "
                f"{_size(report['bytes_moved_in_it'])})"
                if report["last_iteration_with_moves"] is not None
                else ""
            ),
            "  optimizer-state groups: "
            + (
                "not placed yet"
                if homes is None
                else ", ".join(f"{tier} {n}" for tier, n in homes.items())
            ),
            f"  html (re-rendered): {report['html']}",
            f"  png summary: {report['png']}",
        ]
    if metrics is not None:
        lines.append(
            f"training: {metrics['steps']:,} steps, last loss {metrics['last_loss']:.4f}, "
            f"median {metrics['median_tokens_per_s']:,.0f} tokens/s"
        )
    return "\n".join(lines)
