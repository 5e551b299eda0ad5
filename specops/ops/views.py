"""The operators' dashboard page inside the admin, and its panels for the live refresh."""
from __future__ import annotations

from django.contrib import admin
from django.template.response import TemplateResponse

from specops.ops.dashboard import dashboard_context

REFRESH_S = 10


def dashboard(request):
    """The page; ``?panels=1`` returns only its panels (what the page's poll swaps in)."""
    context = {**admin.site.each_context(request), "title": "SpecOps dashboard", "refresh_s": REFRESH_S,
               **dashboard_context()}
    if request.GET.get("panels"):
        return TemplateResponse(request, "admin/specops/dashboard_panels.html", context)  # admin_view: never cached
    return TemplateResponse(request, "admin/specops_dashboard.html", context)
