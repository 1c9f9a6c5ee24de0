"""The HTML report: one self-contained page rendered from the memory-trace document.

It reads only the document :func:`~chunkmem.report.memory_trace.build_memory_trace` returns,
so every number on the page is the one in ``memory_trace.json``. No script, stylesheet or
font is loaded from anywhere: the page works offline and can be mailed as one file. Long runs
stay small: charts show at most :data:`MAX_POINTS` moments (the peak of each run of
consecutive moments) and :data:`MAX_BARS` bars, tables a bounded number of rows, and the page
says when it does so.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from html import escape
from typing import Any

from chunkmem.report.svg import Layer, format_bytes, grouped_bars, stacked_steps

MAX_POINTS = 1500
MAX_BARS = 300
MAX_AGGREGATE_ROWS = 500
RAW_MOVES = 200
_MAX_SEPARATORS = 100
_MAX_SEPARATOR_LABELS = 16
NONMODEL = "non-model"
_COLORS = {
    "param": "#4e79a7",
    "grad": "#f28e2c",
    "master": "#e15759",
    "exp_avg": "#76b7b2",
    "exp_avg_sq": "#59a14f",
    "momentum_buffer": "#76b7b2",  # SGD's one moment, in Adam's first moment's colour
    "workspace": "#edc949",
    NONMODEL: "#af7aa1",
}
_OTHER_COLORS = ("#9c755f", "#bab0ab", "#ff9da7")
_DIRECTION_COLORS = ("#4e79a7", "#e15759", "#59a14f", "#edc949")  # one per destination tier

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1000px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 32px; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.note { color: #555; font-size: 13px; }
.legend span { display: inline-block; margin-right: 14px; }
.legend i { display: inline-block; width: 11px; height: 11px; margin-right: 4px; }
svg text { font-size: 11px; fill: #444; }
svg .axis { stroke: #888; } svg .grid { stroke: #eee; }
svg .sep { stroke: #999; stroke-dasharray: 3 3; }
svg .limit { stroke: #c00; stroke-width: 1.5; stroke-dasharray: 6 3; }
svg .limit-label { fill: #c00; }
svg .hover rect { fill: transparent; } svg .hover rect:hover { fill: rgba(0, 0, 0, 0.08); }
"""


def render_html(doc: dict[str, Any]) -> str:
    """The page for one memory-trace document."""
    summary = doc["summary"]
    sections = [
        f"<h1>chunkmem memory trace</h1><p>{escape(summary['device_kind'])} device, "
        f"{escape(summary['precision'])}, {summary['global_steps']:,} optimizer steps, "
        f"{len(doc['moments']):,} moments. Schema <code>{escape(doc['schema'])}</code>; the "
        "same numbers are in <code>memory_trace.json</code>.</p>",
        _summary_section(summary),
        *(_tier_section(doc, tier) for tier in summary["tiers"]),
        _bytes_moved_section(doc),
        _moves_section(doc),
    ]
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>chunkmem memory trace</title><style>{_STYLE}</style></head><body>"
        + "\n".join(sections)
        + "</body></html>\n"
    )


# ---------------------------------------------------------------- tables
def _cell(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f'<td class="n">{value:,}</td>'
    return f"<td>{escape(str(value))}</td>"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _bytes_text(nbytes: int | None) -> str:
    return "unlimited" if nbytes is None else f"{format_bytes(nbytes)} ({nbytes:,} B)"


def _compression_text(compression: dict[str, Any] | None) -> str:
    if compression is None:
        return "none"
    auto = compression.get("auto")
    if compression["method"] != "auto":
        return compression["method"]
    if auto is None:
        return "auto: not decided yet (exact until the warm-up is timed)"
    return f"auto chose {auto['chosen']} at step {auto['from_step']}: {auto['reason']}"


def _summary_section(summary: dict[str, Any]) -> str:
    chunks = summary["chunks"]
    search = chunks["search"]
    elements = chunks["used_elements"] + chunks["padding_elements"]
    homes = summary["optimizer_state_homes"]
    run = [
        ("device", summary["device_kind"]),
        ("precision", summary["precision"]),
        ("optimizer steps", summary["global_steps"]),
        ("iterations", summary["iterations"]),
        ("loss scale", f"{summary['loss_scale']:g}"),
        ("steps skipped (overflow or non-finite)", summary["skipped_steps"]),
        (
            "speculative host updates: steps committed / rolled back",
            f"{summary.get('speculative_commits', 0)} / {summary.get('speculative_rollbacks', 0)}",
        ),
        ("gradient compression", _compression_text(summary.get("compression"))),
        (
            "traces recorded / divergences",
            f"{summary['tracer']['cycles_recorded']} / {summary['tracer']['divergences']}",
        ),
        (
            "optimizer-state homes (chunk groups)",
            "not placed yet"
            if homes is None
            else ", ".join(f"{tier} {count}" for tier, count in homes.items()),
        ),
        ("gradient slots repaired", ", ".join(summary["repaired_grad_slots"]) or "none"),
        (
            "process peak RSS (operating system)",
            "not recorded"
            if summary.get("peak_rss_bytes") is None
            else _bytes_text(summary["peak_rss_bytes"]),
        ),
    ]
    gpu = summary.get("gpu")
    if gpu is not None:
        run.append(
            (
                f"GPU {gpu['index']} ({gpu['name']}, driver's view)",
                f"{_bytes_text(gpu['used_bytes'])} used of {_bytes_text(gpu['total_bytes'])}, "
                f"{gpu['utilization_percent']}% busy",
            )
        )
    layout = [
        ("chunk size (elements)", chunks["chunk_size_elements"]),
        ("chunk groups (layouts)", chunks["layouts"]),
        ("chunks by kind", ", ".join(f"{k} {v}" for k, v in chunks["chunks_by_kind"].items())),
        (
            "padding (elements)",
            f"{chunks['padding_elements']:,} of {elements:,} "
            f"({_percent(chunks['padding_elements'], elements)})",
        ),
        ("padding (bytes, all kinds)", _bytes_text(summary["padding_bytes"])),
        (
            "size search",
            f"{search['candidates_tried']} candidates tried, "
            f"{search['oversized_tensors']} tensors larger than a chunk",
        ),
    ]
    tiers = [
        (
            name,
            _bytes_text(tier["capacity"]),
            _bytes_text(tier["peak"]),
            _percent(tier["peak"], tier["capacity"]),
            _bytes_text(tier["peak_model"]),
        )
        for name, tier in summary["tiers"].items()
    ]
    state = [(kind, _bytes_text(nbytes)) for kind, nbytes in summary["model_state_bytes"].items()]
    return (
        "<h2>Summary</h2>"
        + _table(["run", ""], run)
        + _table(["chunks", ""], layout)
        + _table(["tier", "capacity", "peak", "peak / capacity", "peak of model state"], tiers)
        + _table(["model state (chunks, both tiers)", "bytes"], state)
    )


def _percent(part: int, whole: int | None) -> str:
    return "n/a" if not whole else f"{100 * part / whole:.1f}%"


# ---------------------------------------------------------------- charts
def _pick_points(totals: Sequence[int], limit: int) -> list[int]:
    """All indices, or the index of the largest total in each run of consecutive ones."""
    if len(totals) <= limit:
        return list(range(len(totals)))
    size = math.ceil(len(totals) / limit)
    return [
        max(range(start, min(start + size, len(totals))), key=totals.__getitem__)
        for start in range(0, len(totals), size)
    ]


def _legend(layers: Sequence[Layer]) -> str:
    items = "".join(
        f'<span><i style="background:{layer.color}"></i>{escape(layer.name)}</span>'
        for layer in layers
    )
    return f'<div class="legend">{items}</div>'


def _tier_section(doc: dict[str, Any], tier: str) -> str:
    moments = doc["moments"]
    capacity = doc["summary"]["tiers"][tier]["capacity"]
    heading = f"<h2>{tier.capitalize()} bytes at each moment</h2>"
    if not moments:
        return heading + '<p class="note">No moment was recorded (no forward ran).</p>'

    compute = "nonmodel" in moments[0][tier]
    values = [_tier_values(moment, tier) for moment in moments]
    totals = [sum(v.values()) for v in values]
    points = _pick_points(totals, MAX_POINTS)
    names = [*doc["kinds"], NONMODEL] if compute else doc["kinds"]
    layers = [
        Layer(name, _color(name, position), [values[i][name] for i in points])
        for position, name in enumerate(names)
        if any(v[name] for v in values)
    ]
    hover = [_moment_hover(moments[i], values[i], totals[i], capacity) for i in points]
    separators, notes = _iteration_separators([moments[i]["iteration"] for i in points])
    if len(points) < len(moments):
        notes.append(
            f"Showing {len(points):,} of {len(moments):,} moments: each point is the moment with "
            f"the most {tier} bytes among {math.ceil(len(moments) / MAX_POINTS):,} consecutive "
            "moments, so peaks are kept. memory_trace.json has every moment."
        )
    chart = stacked_steps(
        layers, hover, title=f"{tier} bytes per moment", limit=capacity, separators=separators
    )
    what = (
        "chunk kind, plus non-model bytes (activations saved for backward, gradients in flight)"
        if compute
        else "chunk kind"
    )
    intro = (
        f'<p class="note">Bytes at the start of each moment (a module\'s forward or backward, '
        f"or an optimizer step on one chunk group), stacked by {what}. Hover a column for the "
        "moment and its numbers; dashed lines separate iterations.</p>"
    )
    return heading + intro + _legend(layers) + chart + _notes(notes)


def _tier_values(moment: dict[str, Any], tier: str) -> dict[str, int]:
    """Bytes by kind on ``tier`` at a moment, plus non-model bytes on the compute tier."""
    values = dict(moment[tier]["by_kind"])
    if "nonmodel" in moment[tier]:
        values[NONMODEL] = moment[tier]["nonmodel"]
    return values


def _color(name: str, position: int) -> str:
    return _COLORS.get(name, _OTHER_COLORS[position % len(_OTHER_COLORS)])


def _moment_hover(
    moment: dict[str, Any], values: dict[str, int], total: int, capacity: int | None
) -> str:
    lines = [f"iteration {moment['iteration']}, moment {moment['index']}: {moment['label']}"]
    lines += [f"{name} {format_bytes(v)}" for name, v in values.items() if v]
    share = f" ({_percent(total, capacity)} of capacity)" if capacity else ""
    lines.append(f"total {format_bytes(total)}{share}")
    return "\n".join(lines)


def _iteration_separators(iterations: Sequence[int]) -> tuple[list[tuple[int, str]], list[str]]:
    starts = [i for i in range(1, len(iterations)) if iterations[i] != iterations[i - 1]]
    if len(starts) > _MAX_SEPARATORS:
        return [], ["Too many iterations to separate by lines."]
    labelled = len(starts) < _MAX_SEPARATOR_LABELS
    return [(i, f"iteration {iterations[i]}" if labelled else "") for i in starts], []


def _notes(notes: Sequence[str]) -> str:
    return "".join(f'<p class="note">{escape(note)}</p>' for note in notes)


def _bytes_moved_section(doc: dict[str, Any]) -> str:
    heading = "<h2>Bytes moved per iteration</h2>"
    per_iteration = {row["iteration"]: row for row in doc["bytes_moved"]}
    if not per_iteration:
        return heading + '<p class="note">No chunk moved between tiers.</p>'
    iterations = list(range(min(per_iteration), max(per_iteration) + 1))
    size = math.ceil(len(iterations) / MAX_BARS)
    groups = [iterations[start : start + size] for start in range(0, len(iterations), size)]
    labels = [str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups]
    directions = [key for key in doc["bytes_moved"][0] if key.startswith("to_")]
    layers = [
        Layer(
            direction.replace("_", " "),
            _DIRECTION_COLORS[position % len(_DIRECTION_COLORS)],
            [sum(per_iteration.get(i, {}).get(direction, 0) for i in g) for g in groups],
        )
        for position, direction in enumerate(directions)
    ]
    notes = []
    if size > 1:
        notes.append(f"Each bar sums {size:,} consecutive iterations ({len(iterations):,} in all).")
    chart = grouped_bars(labels, layers, title="bytes moved per iteration")
    return heading + _legend(layers) + chart + _notes(notes)


def _moves_section(doc: dict[str, Any]) -> str:
    moves = doc["moves"]
    heading = "<h2>Chunk moves</h2>"
    notes = []
    if doc["moves_dropped"]:
        notes.append(
            f"{doc['moves_dropped']:,} later moves were counted but not recorded "
            "(report.max_move_events); the tables below cover the recorded ones, the chart "
            "above all of them."
        )
    if not moves:
        return heading + '<p class="note">No chunk moved between tiers.</p>' + _notes(notes)
    whole_run = _aggregate(moves, ("direction", "kind", "reason"))
    per_iteration = _aggregate(moves, ("iteration", "direction", "kind", "reason"))
    if len(per_iteration) > MAX_AGGREGATE_ROWS:
        notes.append(
            f"The first {MAX_AGGREGATE_ROWS:,} of {len(per_iteration):,} rows are shown; the "
            "whole-run table above covers every recorded move."
        )
    raw = [
        (
            m["seq"],
            m["iteration"],
            m["moment"],
            m["chunk_id"],
            m["kind"],
            m["src"],
            m["dst"],
            m["nbytes"],
            m["reason"],
        )
        for m in moves[:RAW_MOVES]
    ]
    return (
        heading
        + '<p class="note">Whole run, by direction, chunk kind and reason.</p>'
        + _table(["direction", "kind", "reason", "moves", "bytes"], whole_run)
        + '<p class="note">By iteration, direction, chunk kind and reason.</p>'
        + _table(
            ["iteration", "direction", "kind", "reason", "moves", "bytes"],
            per_iteration[:MAX_AGGREGATE_ROWS],
        )
        + _notes(notes)
        + f"<h2>First {len(raw):,} of {len(moves):,} recorded moves</h2>"
        + _table(
            ["seq", "iteration", "moment", "chunk", "kind", "from", "to", "bytes", "reason"], raw
        )
    )


def _aggregate(moves: Sequence[dict[str, Any]], fields: Sequence[str]) -> list[tuple[Any, ...]]:
    """Rows of ``fields`` values, move count and bytes, sorted by ``fields``."""
    counts: Counter[tuple[Any, ...]] = Counter()
    nbytes: Counter[tuple[Any, ...]] = Counter()
    for move in moves:
        key = tuple(move[field] for field in fields)
        counts[key] += 1
        nbytes[key] += move["nbytes"]
    return [(*key, counts[key], nbytes[key]) for key in sorted(counts)]
