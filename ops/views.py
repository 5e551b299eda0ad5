"""The operators' dashboard page inside the admin, and its panels for the live refresh."""
from __future__ import annotations

from django.contrib import admin
from django.template.response import TemplateResponse

from ops.dashboard import dashboard_context

REFRESH_S = 10


def dashboard(request):
    """The page; ``?panels=1`` returns only its panels (what the page's poll swaps in)."""
    context = {**admin.site.each_context(request), "title": "SpecOps dashboard", "refresh_s": REFRESH_S,
               **dashboard_context()}
    if request.GET.get("panels"):
        return TemplateResponse(request, "admin/specops/dashboard_panels.html", context)  # admin_view: never cached
    return TemplateResponse(request, "admin/specops_dashboard.html", context)


def latency_budget(request):
    """The latency budget: each component's measured p95 against its budget."""
    from core.charts import Reference, Series, bar_chart
    from core.latency_budget import budget_context

    numbers = budget_context()
    points = [(line.component.label, line.used_percent) for line in numbers["lines"]]
    chart = bar_chart(Series("p95 as % of its budget", points), unit="%",
                      reference=Reference("budget", 100.0)) if any(v is not None for _, v in points) else ""
    context = {**admin.site.each_context(request), "title": "Latency budget", "chart": chart, **numbers}
    return TemplateResponse(request, "admin/specops/latency_budget.html", context)
