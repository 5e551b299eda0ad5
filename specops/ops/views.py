"""The operators' dashboard page inside the admin."""
from __future__ import annotations

from django.contrib import admin
from django.template.response import TemplateResponse

from specops.ops.dashboard import dashboard_context


def dashboard(request):
    context = {**admin.site.each_context(request), "title": "SpecOps dashboard", **dashboard_context()}
    return TemplateResponse(request, "admin/specops_dashboard.html", context)
