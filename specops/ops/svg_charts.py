"""Tiny server-side SVG charts for the admin dashboards.

Hand-written on purpose: the admin must render with no network (no CDN chart library) and the
charts are simple bars and lines; a plotting dependency would be larger than this module.
"""
from __future__ import annotations

from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT, PAD = 560, 180, 28


@dataclass(frozen=True)
class Series:
    label: str
    points: list[tuple[str, float | None]]  # (x label, value); None leaves a gap
    color: str = "#417690"


def _scale(value: float, top: float) -> float:
    return HEIGHT - PAD - (value / top) * (HEIGHT - 2 * PAD) if top else HEIGHT - PAD


def bar_chart(series: Series, unit: str = "", reference: tuple[str, float] | None = None) -> str:
    """Bars for one series, with an optional horizontal reference line (an SLO, say)."""
    values = [v for _, v in series.points if v is not None]
    top = max(values + ([reference[1]] if reference else []) + [1e-9]) * 1.1
    n = max(len(series.points), 1)
    step = (WIDTH - 2 * PAD) / n
    parts = []
    for i, (label, value) in enumerate(series.points):
        if value is None:
            continue
        x, y = PAD + i * step, _scale(value, top)
        parts.append(f'<rect x="{x + 2:.1f}" y="{y:.1f}" width="{max(step - 4, 1):.1f}" '
                     f'height="{HEIGHT - PAD - y:.1f}" fill="{series.color}"><title>{escape(label)}: '
                     f'{value:.3g}{escape(unit)}</title></rect>')
        if n <= 24:
            parts.append(f'<text x="{x + step / 2:.1f}" y="{HEIGHT - 10}" font-size="9" '
                         f'text-anchor="middle">{escape(label)}</text>')
    parts += _reference(reference, top) + _axis(top, unit)
    return _svg(series.label, parts)


def line_chart(series_list: list[Series], unit: str = "", top: float | None = None) -> str:
    """Lines for several series sharing an x axis (e.g. hit rates per tier over time)."""
    values = [v for s in series_list for _, v in s.points if v is not None]
    top = top or (max(values + [1e-9]) * 1.1)
    parts = []
    for s in series_list:
        n = max(len(s.points) - 1, 1)
        coords = [(PAD + i * (WIDTH - 2 * PAD) / n, _scale(v, top)) for i, (_, v) in enumerate(s.points)
                  if v is not None]
        if coords:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
            parts.append(f'<polyline fill="none" stroke="{s.color}" stroke-width="2" points="{path}"/>')
    legend = " · ".join(f'<tspan fill="{s.color}">{escape(s.label)}</tspan>' for s in series_list)
    parts.append(f'<text x="{PAD}" y="12" font-size="10">{legend}</text>')
    return _svg("", parts + _axis(top, unit))


def _reference(reference: tuple[str, float] | None, top: float) -> list[str]:
    if not reference:
        return []
    label, value = reference
    y = _scale(value, top)
    return [f'<line x1="{PAD}" x2="{WIDTH - PAD}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ba2121" '
            f'stroke-dasharray="4 3"/>',
            f'<text x="{WIDTH - PAD}" y="{y - 3:.1f}" font-size="9" text-anchor="end" fill="#ba2121">'
            f'{escape(label)}</text>']


def _axis(top: float, unit: str) -> list[str]:
    return [f'<line x1="{PAD}" x2="{PAD}" y1="{PAD}" y2="{HEIGHT - PAD}" stroke="#999"/>',
            f'<text x="2" y="{PAD}" font-size="9">{top / 1.1:.3g}{escape(unit)}</text>']


def _svg(title: str, parts: list[str]) -> str:
    heading = f'<text x="{WIDTH / 2}" y="12" font-size="11" text-anchor="middle">{escape(title)}</text>'
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}">{heading}{"".join(parts)}</svg>')
