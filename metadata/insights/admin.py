"""The admin pages of the insights: hot queries (with the latency heatmap) and the capacity plan.

Both hang off the ``StatementBaseline`` admin (the statements pg_stat_statements knows now, per
database): ``admin:metadata_hot_queries`` and ``admin:metadata_capacity``. Reads go to the
primary; the charts are server-side SVG.
"""
from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.db import DatabaseError, connections
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import path

from core.charts import Series, bar_chart, line_chart
from metadata.conf import conf
from metadata.insights.capacity import capacity_plan
from metadata.insights.heatmap import heatmap_svg, latency_heatmap
from metadata.insights.hot_queries import ORDERS, hot_queries, with_plans
from metadata.insights.statement_snapshots import MARKER_QUERYID, database_aliases
from metadata.insights.window import WINDOW_CHOICES_HOURS, Window
from metadata.models import StatementBaseline

LIMIT = 20
COLORS = ("#417690", "#ba2121", "#5b8c2a", "#b36b00", "#6a3d9a")


def _choice(request: HttpRequest, name: str, allowed, default):
    value = request.GET.get(name, "")
    try:
        value = type(default)(value) if value else default
    except ValueError:
        return default
    return value if value in allowed else default


def _float(request: HttpRequest, name: str, default: float, low: float, high: float) -> float:
    try:
        value = float(request.GET.get(name, default))
    except ValueError:
        return default
    return min(max(value, low), high)


def statements_status(alias: str) -> str:
    """"" when pg_stat_statements answers on ``alias``, else why not (one line)."""
    try:
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT to_regclass('pg_stat_statements') IS NOT NULL")
            if not cursor.fetchone()[0]:
                return "extension pg_stat_statements not created in this database"
            cursor.execute("SELECT dealloc FROM pg_stat_statements_info")
    except DatabaseError as exc:
        return " ".join(str(exc).split())[:200]
    return ""


def _last_snapshots() -> dict[str, object]:
    return dict(StatementBaseline.objects.using("default").filter(queryid=MARKER_QUERYID)
                .values_list("database", "taken_at"))


def hot_queries_context(hours: int, database: str, order: str) -> dict:
    window = Window.last(hours)
    aliases = database_aliases()
    chosen = [database] if database else aliases
    found = hot_queries(window, order, LIMIT, chosen)
    last = _last_snapshots()
    databases = []
    for alias in chosen:
        entry = found.get(alias)
        databases.append({
            "alias": alias,
            "server": f"{settings.DATABASES[alias].get('HOST')}:{settings.DATABASES[alias].get('PORT')}",
            "status": statements_status(alias),
            "last_snapshot": last.get(alias),
            "total_ms": entry.total_ms if entry else 0.0,
            "calls": entry.calls if entry else 0,
            "statements": with_plans(entry.statements) if entry else [],
        })
    heatmap = latency_heatmap(window, database or None)
    return {"window": window, "databases": databases, "aliases": aliases, "database": database, "order": order,
            "orders": list(ORDERS), "hours": hours, "hour_choices": WINDOW_CHOICES_HOURS,
            "heatmap_svg": heatmap_svg(heatmap), "heatmap": heatmap}


def capacity_context(hours: int, buffer: float) -> dict:
    plan = capacity_plan(hours=hours, buffer=buffer)
    statement_series = [Series(d.database, [(f"{at:%H:%M}", rate) for at, rate in d.series], COLORS[i % len(COLORS)])
                        for i, d in enumerate(plan.databases)]
    return {
        "plan": plan, "needs": plan.needs, "hours": hours, "buffer": buffer, "hour_choices": WINDOW_CHOICES_HOURS,
        "statements_chart": line_chart(statement_series, "/s") if any(s.points for s in statement_series) else "",
        "tokens_chart": bar_chart(Series("tokens/s", [(f"{at:%H:%M}", v) for at, v in plan.token_series]), "/s")
        if plan.token_series else "",
        "lines": plan.lines(),
    }


@admin.register(StatementBaseline)
class StatementBaselineAdmin(admin.ModelAdmin):
    list_display = ("database", "queryid", "calls", "total_time_ms", "max_time_ms", "rows", "short_query", "taken_at")
    list_filter = ("database",)
    search_fields = ("query",)
    ordering = ("-total_time_ms",)
    readonly_fields = [f.name for f in StatementBaseline._meta.fields]
    change_list_template = "admin/insights/statementbaseline_change_list.html"
    show_full_result_count = False

    @admin.display(description="statement")
    def short_query(self, baseline: StatementBaseline) -> str:
        return baseline.query[:120]

    def has_add_permission(self, request) -> bool:
        return False  # written by the snapshot job only

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def get_urls(self):
        site = self.admin_site
        return [
            path("hot-queries/", site.admin_view(self.hot_queries_view), name="metadata_hot_queries"),
            path("capacity/", site.admin_view(self.capacity_view), name="metadata_capacity"),
        ] + super().get_urls()

    def hot_queries_view(self, request):
        hours = _choice(request, "hours", WINDOW_CHOICES_HOURS, 24)
        database = _choice(request, "database", database_aliases(), "")
        order = _choice(request, "order", tuple(ORDERS), "total")
        context = {**self.admin_site.each_context(request), "title": "Hot queries", "opts": self.model._meta,
                   **hot_queries_context(hours, database, order)}
        return TemplateResponse(request, "admin/insights/hot_queries.html", context)

    def capacity_view(self, request):
        hours = _choice(request, "hours", WINDOW_CHOICES_HOURS, 24)
        buffer = _float(request, "buffer", float(conf.CAPACITY_BUFFER), 1.0, 10.0)
        context = {**self.admin_site.each_context(request), "title": "Capacity plan", "opts": self.model._meta,
                   **capacity_context(hours, buffer)}
        return TemplateResponse(request, "admin/insights/capacity.html", context)
