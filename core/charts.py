"""Small server-side SVG charts for the admin pages: bars and lines with axes, units and values.

Hand-written on purpose: the admin must render with no network (no CDN chart library) and the
charts are simple; a plotting dependency would be larger than this module. Every chart has a y
axis with ticks in its unit, x labels, an optional reference line (an SLO) and one element per
data point (``class="point"``, with a ``<title>`` tooltip "x: value unit" and ``data-value``), so
a person can hover any value and a browser test can count the points. An empty chart says so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 600, 200
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 22, 30  # plot margins: room for tick labels and the legend
PALETTE = ("#417690", "#e08e0b", "#70bf2b", "#ba2121", "#8e44ad", "#16a085", "#7f8c8d", "#d35400")


@dataclass(frozen=True)
class Series:
    label: str
    points: list[tuple[str, float | None]]  # (x label, value); None leaves a gap
    color: str = PALETTE[0]


@dataclass(frozen=True)
class Reference:
    """A horizontal line across the plot (an SLO, a target)."""

    label: str
    value: float
    color: str = "#ba2121"


def format_value(value: float, unit: str = "") -> str:
    """A short human number: 3 significant digits, thousands as k/M."""
    if unit == "%":
        return f"{value:.1f}%"
    magnitude = abs(value)
    if magnitude >= 1e6:
        text = f"{value / 1e6:.3g}M"
    elif magnitude >= 1e4:
        text = f"{value / 1e3:.3g}k"
    else:
        text = f"{value:.3g}"
    return f"{text} {unit}".strip() if unit and unit != "%" else text


def nice_top(value: float) -> float:
    """The smallest 1/2/2.5/5 x 10^k at or above ``value`` (a round top for the y axis)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        top = step * 10 ** exponent
        if top >= value * 0.999:
            return top
    return 10 ** (exponent + 1)


class _Plot:
    def __init__(self, top: float, n: int) -> None:
        self.top, self.n = top, max(n, 1)
        self.width = WIDTH - LEFT - RIGHT
        self.height = HEIGHT - TOP - BOTTOM

    def y(self, value: float) -> float:
        return TOP + self.height * (1 - min(max(value, 0.0), self.top) / self.top)

    def x_center(self, index: int) -> float:
        return LEFT + self.width * (index + 0.5) / self.n


def bar_chart(series: Series, unit: str = "", reference: Reference | tuple[str, float] | None = None,
              title: str = "", top: float | None = None) -> str:
    """Bars of one series, each labelled with its value when there is room."""
    reference = _as_reference(reference)
    values = [v for _, v in series.points if v is not None]
    plot = _Plot(top or nice_top(max(values + ([reference.value] if reference else []) + [0.0])), len(series.points))
    slot = plot.width / plot.n
    parts = []
    for index, (label, value) in enumerate(series.points):
        if value is None:
            continue
        x, y = plot.x_center(index) - slot * 0.4, plot.y(value)
        parts.append(f'<rect class="point" data-value="{value:.6g}" x="{x:.1f}" y="{y:.1f}" '
                     f'width="{max(slot * 0.8, 1):.1f}" height="{TOP + plot.height - y:.1f}" fill="{series.color}">'
                     f'<title>{escape(label)}: {escape(format_value(value, unit))}</title></rect>')
        if plot.n <= 24:
            parts.append(f'<text x="{plot.x_center(index):.1f}" y="{max(y - 3, TOP + 8):.1f}" font-size="9" '
                         f'text-anchor="middle">{escape(format_value(value, unit))}</text>')
    parts += _x_labels([label for label, _ in series.points], plot)
    parts += _reference(reference, plot)
    legend = [Series(series.label, [], series.color)] if series.label else []
    return _svg(title or series.label, _y_axis(plot, unit) + parts + _legend(legend), len(values))


def line_chart(series_list: list[Series], unit: str = "", top: float | None = None,
               reference: Reference | tuple[str, float] | None = None, title: str = "") -> str:
    """Lines for several series sharing the x labels of the first one."""
    reference = _as_reference(reference)
    values = [v for s in series_list for _, v in s.points if v is not None]
    labels = [label for label, _ in series_list[0].points] if series_list else []
    plot = _Plot(top or nice_top(max(values + ([reference.value] if reference else []) + [0.0])), len(labels))
    parts = []
    for s in series_list:
        coords = [(plot.x_center(i), plot.y(v), label, v) for i, (label, v) in enumerate(s.points) if v is not None]
        for run in _runs(s.points):
            path = " ".join(f"{plot.x_center(i):.1f},{plot.y(v):.1f}" for i, v in run)
            parts.append(f'<polyline fill="none" stroke="{s.color}" stroke-width="2" points="{path}"/>')
        for x, y, label, v in coords:
            parts.append(f'<circle class="point" data-value="{v:.6g}" cx="{x:.1f}" cy="{y:.1f}" r="2.5" '
                         f'fill="{s.color}"><title>{escape(s.label)} at {escape(label)}: '
                         f'{escape(format_value(v, unit))}</title></circle>')
    parts += _x_labels(labels, plot)
    parts += _reference(reference, plot)
    return _svg(title, _y_axis(plot, unit) + parts + _legend(series_list), len(values))


def _runs(points: list[tuple[str, float | None]]) -> list[list[tuple[int, float]]]:
    """Consecutive non-missing points (a None breaks the line)."""
    runs: list[list[tuple[int, float]]] = [[]]
    for index, (_, value) in enumerate(points):
        if value is None:
            runs.append([])
        else:
            runs[-1].append((index, value))
    return [run for run in runs if len(run) > 1]


def _as_reference(reference: Reference | tuple[str, float] | None) -> Reference | None:
    if reference is None or isinstance(reference, Reference):
        return reference
    return Reference(*reference)


def _y_axis(plot: _Plot, unit: str) -> list[str]:
    parts = [f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + plot.height}" stroke="#999"/>',
             f'<line x1="{LEFT}" x2="{LEFT + plot.width}" y1="{TOP + plot.height}" y2="{TOP + plot.height}" '
             f'stroke="#999"/>']
    for fraction in (0.25, 0.5, 0.75, 1.0):
        value = plot.top * fraction
        y = plot.y(value)
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + plot.width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        parts.append(f'<text class="tick" x="{LEFT - 4}" y="{y + 3:.1f}" font-size="9" text-anchor="end">'
                     f'{escape(format_value(value, unit))}</text>')
    parts.append(f'<text class="tick" x="{LEFT - 4}" y="{TOP + plot.height + 3:.1f}" font-size="9" '
                 f'text-anchor="end">0</text>')
    return parts


def _x_labels(labels: list[str], plot: _Plot) -> list[str]:
    if not labels:
        return []
    every = max(1, math.ceil(len(labels) / 12))
    return [f'<text x="{plot.x_center(i):.1f}" y="{HEIGHT - BOTTOM + 12}" font-size="9" text-anchor="middle">'
            f'{escape(label)}</text>' for i, label in enumerate(labels) if i % every == 0 or i == len(labels) - 1]


def _reference(reference: Reference | None, plot: _Plot) -> list[str]:
    if reference is None:
        return []
    y = plot.y(reference.value)
    return [f'<line x1="{LEFT}" x2="{LEFT + plot.width}" y1="{y:.1f}" y2="{y:.1f}" stroke="{reference.color}" '
            f'stroke-dasharray="4 3"/>',
            f'<text x="{LEFT + plot.width}" y="{y - 3:.1f}" font-size="9" text-anchor="end" '
            f'fill="{reference.color}">{escape(reference.label)}</text>']


def _legend(series_list: list[Series]) -> list[str]:
    if not series_list:
        return []
    items = " ".join(f'<tspan fill="{s.color}">■ {escape(s.label)}</tspan>' for s in series_list)
    return [f'<text x="{LEFT}" y="{TOP - 6}" font-size="10">{items}</text>']


def _svg(title: str, parts: list[str], n_points: int) -> str:
    heading = (f'<text x="{WIDTH - RIGHT}" y="{TOP - 6}" font-size="11" font-weight="bold" text-anchor="end">'
               f'{escape(title)}</text>') if title else ""
    empty = ("" if n_points else f'<text x="{LEFT + (WIDTH - LEFT - RIGHT) / 2}" y="{HEIGHT / 2}" font-size="11" '
             f'text-anchor="middle" fill="#999">no data in this window</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-points="{n_points}" width="{WIDTH}" '
            f'height="{HEIGHT}" role="img" aria-label="{escape(title)}" viewBox="0 0 {WIDTH} {HEIGHT}">'
            f'{heading}{"".join(parts)}{empty}</svg>')
