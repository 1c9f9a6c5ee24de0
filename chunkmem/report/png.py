"""A PNG summary of a memory-trace document, for a chat message or an issue.

Two panels drawn by matplotlib (a well-kept plotting library; a PNG encoder by hand would be
more code than the report): the compute tier's bytes at every recorded moment, stacked by
chunk kind with non-model memory on top and the capacity as a line, and the bytes moved into
each tier per iteration. Every number is read from the document, as the HTML page's are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_MIB = 2**20


def compute_tier(document: dict[str, Any]) -> str:
    """The tier whose moment samples carry non-model memory (the device the model runs on)."""
    for moment in document["moments"]:
        for tier, sample in moment.items():
            if isinstance(sample, dict) and "nonmodel" in sample:
                return tier
    return next(iter(document["summary"]["tiers"]))


def write_png(document: dict[str, Any], path: Path) -> Path:
    """Draw the summary of ``document`` into ``path`` (written whole, then renamed)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    from matplotlib import pyplot

    tier = compute_tier(document)
    figure, (over_time, moved) = pyplot.subplots(2, 1, figsize=(10, 7), layout="constrained")
    try:
        _draw_moments(over_time, document, tier)
        _draw_moves(moved, document)
        temporary = path.with_name(path.name + ".tmp")
        figure.savefig(temporary, format="png", dpi=100)
        temporary.replace(path)
    finally:
        pyplot.close(figure)
    return path


def _draw_moments(axes: Any, document: dict[str, Any], tier: str) -> None:
    moments = [m for m in document["moments"] if tier in m]
    positions = range(len(moments))
    layers = {
        kind: [m[tier]["by_kind"].get(kind, 0) / _MIB for m in moments]
        for kind in document["kinds"]
    }
    layers = {kind: values for kind, values in layers.items() if any(values)}
    layers["non-model"] = [m[tier].get("nonmodel", 0) / _MIB for m in moments]
    if moments:
        axes.stackplot(positions, *layers.values(), labels=list(layers), step="post")
    capacity = document["summary"]["tiers"][tier]["capacity"]
    if capacity:
        axes.axhline(capacity / _MIB, color="black", linestyle="--", label="capacity")
    axes.set_title(f"{tier} bytes at each recorded moment")
    axes.set_xlabel("moment (in the order recorded)")
    axes.set_ylabel("MiB")
    axes.legend(loc="upper left", fontsize="small", ncols=3)


def _draw_moves(axes: Any, document: dict[str, Any]) -> None:
    rows = document["bytes_moved"]
    iterations = [row["iteration"] for row in rows]
    directions = sorted({key for row in rows for key in row if key.startswith("to_")})
    for direction in directions:
        axes.plot(
            iterations, [row.get(direction, 0) / _MIB for row in rows], marker=".", label=direction
        )
    axes.set_title("bytes moved between tiers per iteration")
    axes.set_xlabel("iteration")
    axes.set_ylabel("MiB")
    if directions:
        axes.legend(loc="upper right", fontsize="small")
    else:
        axes.text(0.5, 0.5, "no bytes moved", ha="center", va="center", transform=axes.transAxes)
