"""Inline SVG charts for the HTML report: a stacked step chart and grouped bars.

Plain strings, no plotting library, no script: the page must open offline from one file.
Every text that goes into the markup passes through :func:`html.escape` here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 960, 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 78, 12, 18, 26
_PLOT_W = WIDTH - _LEFT - _RIGHT
_PLOT_H = HEIGHT - _TOP - _BOTTOM
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


@dataclass(frozen=True)
class Layer:
    """One named series of byte counts, drawn in ``color``."""

    name: str
    color: str
    values: Sequence[int]


def format_bytes(nbytes: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(nbytes)
    for unit in _UNITS[:-1]:
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{_one_decimal(value)} {unit}"
        value /= 1024
    return f"{_one_decimal(value)} {_UNITS[-1]}"


def _one_decimal(value: float) -> str:
    return f"{value:.1f}".removesuffix(".0")


def _y(value: float, top: float) -> float:
    return _TOP + _PLOT_H - (value / top) * _PLOT_H if top else _TOP + _PLOT_H


def _x(position: float, count: int) -> float:
    return _LEFT + position * _PLOT_W / max(count, 1)


def _tick_step(top: float) -> float:
    """A round step (1, 2, 2.5 or 5 times a power of ten, in the unit of ``top``) for ~4 ticks."""
    unit = 1024 ** min(int(math.log(max(top, 1), 1024)), len(_UNITS) - 1)
    raw = top / unit / 4
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    return max(step * unit, 1)


def _axes(top: float) -> list[str]:
    parts = [
        f'<line x1="{_LEFT}" y1="{_TOP + _PLOT_H}" x2="{_LEFT + _PLOT_W}" y2="{_TOP + _PLOT_H}" '
        'class="axis"/>',
        f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_TOP + _PLOT_H}" class="axis"/>',
    ]
    step = _tick_step(top)
    for tick in range(int(top // step) + 1):
        value = tick * step
        y = _y(value, top)
        parts.append(
            f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{_LEFT + _PLOT_W}" y2="{y:.1f}" class="grid"/>'
        )
        parts.append(
            f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{format_bytes(value)}</text>'
        )
    return parts


def _svg(parts: list[str], title: str) -> str:
    return (
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{escape(title)}">' + "".join(parts) + "</svg>"
    )


def stacked_steps(
    layers: Sequence[Layer],
    hover: Sequence[str],
    *,
    title: str,
    limit: int | None = None,
    separators: Sequence[tuple[int, str]] = (),
) -> str:
    """Layers stacked bottom-up; point ``i`` holds from ``x=i`` to ``x=i+1``.

    ``hover[i]`` is the tooltip of point ``i``; ``limit`` draws a capacity line;
    ``separators`` are ``(point, label)`` vertical lines (e.g. where an iteration starts).
    """
    count = len(hover)
    totals = [sum(layer.values[i] for layer in layers) for i in range(count)]
    top = max([*totals, limit or 0, 1]) * 1.05
    parts = _axes(top)
    base = [0] * count
    for layer in layers:
        upper = [b + v for b, v in zip(base, layer.values, strict=True)]
        parts.append(
            f'<path d="{_step_area(base, upper, top)}" fill="{layer.color}">'
            f"<title>{escape(layer.name)}</title></path>"
        )
        base = upper
    for point, label in separators:
        x = _x(point, count)
        parts.append(
            f'<line x1="{x:.1f}" y1="{_TOP}" x2="{x:.1f}" y2="{_TOP + _PLOT_H}" class="sep"/>'
        )
        if label:
            parts.append(f'<text x="{x + 3:.1f}" y="{_TOP - 5}">{escape(label)}</text>')
    if limit is not None:
        y = _y(limit, top)
        parts.append(
            f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{_LEFT + _PLOT_W}" y2="{y:.1f}" class="limit"/>'
            f'<text x="{_LEFT + _PLOT_W - 4}" y="{y - 4:.1f}" text-anchor="end" class="limit-label">'
            f"capacity {format_bytes(limit)}</text>"
        )
    width = _PLOT_W / max(count, 1)
    parts.append('<g class="hover">')
    for i, text in enumerate(hover):
        parts.append(
            f'<rect x="{_x(i, count):.1f}" y="{_TOP}" width="{width:.2f}" height="{_PLOT_H}">'
            f"<title>{escape(text)}</title></rect>"
        )
    parts.append("</g>")
    return _svg(parts, title)


def _step_area(lower: Sequence[int], upper: Sequence[int], top: float) -> str:
    """An SVG path between two step lines: along ``upper`` forward, back along ``lower``."""
    count = len(upper)
    path = [f"M{_x(0, count):.1f} {_y(upper[0], top):.1f}"]
    for i, value in enumerate(upper):
        path.append(f"V{_y(value, top):.1f}H{_x(i + 1, count):.1f}")
    for i in range(count - 1, -1, -1):
        path.append(f"V{_y(lower[i], top):.1f}H{_x(i, count):.1f}")
    return "".join(path) + "Z"


def grouped_bars(categories: Sequence[str], layers: Sequence[Layer], *, title: str) -> str:
    """One group of side-by-side bars per category, one bar per layer."""
    count = len(categories)
    top = max([v for layer in layers for v in layer.values] + [1]) * 1.05
    parts = _axes(top)
    group = _PLOT_W / max(count, 1)
    bar = group * 0.8 / max(len(layers), 1)
    label_every = max(1, count // 12)
    for i, category in enumerate(categories):
        for j, layer in enumerate(layers):
            value = layer.values[i]
            y = _y(value, top)
            parts.append(
                f'<rect x="{_x(i, count) + group * 0.1 + j * bar:.1f}" y="{y:.1f}" '
                f'width="{bar:.2f}" height="{_TOP + _PLOT_H - y:.1f}" fill="{layer.color}">'
                f"<title>{escape(f'{category}: {layer.name} {format_bytes(value)} ({value:,} B)')}"
                "</title></rect>"
            )
        if i % label_every == 0:
            parts.append(
                f'<text x="{_x(i + 0.5, count):.1f}" y="{_TOP + _PLOT_H + 14}" '
                f'text-anchor="middle">{escape(category)}</text>'
            )
    return _svg(parts, title)
