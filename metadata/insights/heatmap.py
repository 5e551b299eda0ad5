"""Where latency comes from: mean statement latency by hour and query family, as an SVG heatmap.

Each cell is one hour of one family (statement kind + main table, ``metadata.insights.statements``):
the time its statements took over the calls it made, from the snapshots of that hour. A hot row
says which family, a hot column says when; the families shown are those with the most total
time. Drawn on the server (no script, no CDN) like the dashboard's charts.
"""
from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from html import escape

from django.db import connections

from metadata.insights.window import Window
from metadata.models import StatementSnapshot

PRIMARY = "default"
LABEL_W, CELL_H, TOP, BOTTOM, MAX_W, MIN_W = 230, 18, 24, 34, 760, 560

_SQL = """
SELECT family, date_trunc('hour', taken_at) AS hour, sum(total_time_ms), sum(calls)::bigint
FROM {table}
WHERE taken_at > %s AND taken_at <= %s {database_filter}
GROUP BY 1, 2
"""


@dataclass(frozen=True)
class Cell:
    mean_ms: float
    calls: int
    total_ms: float


@dataclass
class Heatmap:
    hours: list[dt.datetime]
    families: list[str]  # hottest (most total time) first
    cells: dict[tuple[str, dt.datetime], Cell] = field(default_factory=dict)

    def max_mean(self) -> float:
        return max((c.mean_ms for c in self.cells.values()), default=0.0)


def latency_heatmap(window: Window, database: str | None = None, families: int = 12) -> Heatmap:
    database_filter, params = "", [window.start, window.end]
    if database:
        database_filter, params = "AND database = %s", params + [database]
    with connections[PRIMARY].cursor() as cursor:
        cursor.execute(_SQL.format(table=StatementSnapshot._meta.db_table, database_filter=database_filter), params)
        rows = cursor.fetchall()
    totals: dict[str, float] = {}
    cells = {}
    for family, hour, total_ms, calls in rows:
        totals[family] = totals.get(family, 0.0) + total_ms
        if calls:
            cells[(family, hour)] = Cell(total_ms / calls, calls, total_ms)
    chosen = sorted(totals, key=lambda f: -totals[f])[:families]
    first = window.start.replace(minute=0, second=0, microsecond=0)
    hours = []
    while first <= window.end:
        hours.append(first)
        first += dt.timedelta(hours=1)
    return Heatmap(hours, chosen, {k: v for k, v in cells.items() if k[0] in chosen})


def _color(fraction: float) -> str:
    """Pale yellow (fast) to dark red (slow), on a log scale of the mean latency."""
    low, high = (255, 247, 188), (153, 0, 13)
    r, g, b = (round(lo + (hi - lo) * fraction) for lo, hi in zip(low, high))
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap_svg(heatmap: Heatmap) -> str:
    if not heatmap.families:
        return ""
    n = max(len(heatmap.hours), 1)
    cell_w = max(4.0, min(24.0, (MAX_W - LABEL_W) / n))
    width = max(LABEL_W + n * cell_w + 40, MIN_W)  # room for the last hour's label
    height = TOP + len(heatmap.families) * CELL_H + BOTTOM
    means = [c.mean_ms for c in heatmap.cells.values() if c.mean_ms > 0]
    lo, hi = (math.log10(min(means)), math.log10(max(means))) if means else (0.0, 0.0)
    parts = [f'<text x="4" y="14" font-size="11">mean latency per call, ms (log colour scale: '
             f'{10 ** lo:.3g} .. {10 ** hi:.3g})</text>']
    for row, family in enumerate(heatmap.families):
        y = TOP + row * CELL_H
        parts.append(f'<text x="{LABEL_W - 6}" y="{y + 13}" font-size="10" text-anchor="end">'
                     f'{escape(family[:38])}</text>')
        for col, hour in enumerate(heatmap.hours):
            cell = heatmap.cells.get((family, hour))
            x = LABEL_W + col * cell_w
            if cell is None:
                parts.append(f'<rect x="{x:.1f}" y="{y}" width="{cell_w - 1:.1f}" height="{CELL_H - 1}" '
                             'fill="#f3f3f3"/>')
                continue
            fraction = (math.log10(cell.mean_ms) - lo) / (hi - lo) if hi > lo and cell.mean_ms > 0 else 0.5
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{cell_w - 1:.1f}" height="{CELL_H - 1}" '
                         f'fill="{_color(min(max(fraction, 0.0), 1.0))}"><title>{escape(family)} '
                         f'{hour:%Y-%m-%d %H}:00 UTC: {cell.mean_ms:.3g} ms mean, {cell.calls} calls, '
                         f'{cell.total_ms:.4g} ms total</title></rect>')
    step = max(1, math.ceil(44 / cell_w))  # labels 44 px apart at least
    y = TOP + len(heatmap.families) * CELL_H + 12
    for col in range(0, n, step):
        x = LABEL_W + col * cell_w
        parts.append(f'<text x="{x:.1f}" y="{y}" font-size="9">{heatmap.hours[col]:%d %H}h</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" role="img" '
            f'viewBox="0 0 {width:.0f} {height}">{"".join(parts)}</svg>')
