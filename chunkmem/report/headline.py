"""The few numbers of a memory-trace document a person looks at first.

Read from the document alone (``chunkmem report`` prints them for a finished run), so they
are the numbers of ``memory_trace.json`` and its HTML page, not new ones.
"""

from __future__ import annotations

from typing import Any


def headline(document: dict[str, Any]) -> dict[str, Any]:
    """Peaks per tier, model-state bytes, bytes moved, steps and placement of one run."""
    summary = document["summary"]
    moved = document["bytes_moved"]
    per_iteration = [sum(v for k, v in row.items() if k.startswith("to_")) for row in moved]
    return {
        "device_kind": summary["device_kind"],
        "precision": summary["precision"],
        "global_steps": summary["global_steps"],
        "skipped_steps": summary["skipped_steps"],
        "tiers": {
            name: {"peak_bytes": tier["peak"], "capacity_bytes": tier["capacity"]}
            for name, tier in summary["tiers"].items()
        },
        "model_state_bytes": sum(summary["model_state_bytes"].values()),
        "model_state_bytes_by_kind": summary["model_state_bytes"],
        "padding_bytes": summary["padding_bytes"],
        # Iterations that moved bytes (the ledger keeps the last 1024): their total, and the
        # last of them (the end of a run may be evaluation, which moves nothing).
        "bytes_moved_recorded": sum(per_iteration),
        "iterations_with_moves_recorded": len(per_iteration),
        "last_iteration_with_moves": moved[-1]["iteration"] if moved else None,
        "bytes_moved_in_it": per_iteration[-1] if per_iteration else 0,
        "optimizer_state_homes": summary["optimizer_state_homes"],
        "chunk_size_elements": summary["chunks"]["chunk_size_elements"],
        "layouts": summary["chunks"]["layouts"],
        # The operating system's and the driver's numbers, beside the ledger's (reports
        # written before they were recorded have none).
        "peak_rss_bytes": summary.get("peak_rss_bytes"),
        "speculative_commits": summary.get("speculative_commits", 0),
        "speculative_rollbacks": summary.get("speculative_rollbacks", 0),
        "gpu": summary.get("gpu"),
        "compression": summary.get("compression"),
    }
