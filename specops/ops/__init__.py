"""Operator views of the whole platform: the admin dashboard, the session page, rollups, SVG charts.

``dashboard_view`` is the admin page (``/admin/dashboard/``, ``?panels=1`` for its live refresh),
filled by ``dashboard_context`` from the per-minute and per-hour rollups that ``rollups`` writes
(``roll_up_ops``, a beat job every 30 s; API requests are rolled up on write by the request-log
middleware); ``sample_ops_metrics`` is the beat task that sets the Prometheus gauges;
``bar_chart`` / ``line_chart`` draw ``Series`` as inline SVG with axes, units and values.

Modules: ``views``, ``dashboard``, ``rollups``, ``histograms`` (mergeable latency histograms),
``sampling`` (broker, DEFAULT partitions, replicas), ``gauges`` (the beat entries),
``session_view`` / ``session_timings`` / ``session_actions`` (the admin's session page and cancel),
``svg_charts``. Everything but the charts and histograms needs the models (and the gauges the
Celery app), so it loads on first use.
"""
from __future__ import annotations

from typing import Any

from specops.ops.svg_charts import Series, bar_chart, line_chart

__all__ = ["Series", "bar_chart", "dashboard_context", "dashboard_view", "line_chart", "sample_ops_metrics"]


def __getattr__(name: str) -> Any:
    if name == "dashboard_view":  # not "dashboard": that is the submodule
        from specops.ops.views import dashboard

        return dashboard
    if name == "dashboard_context":
        from specops.ops.dashboard import dashboard_context

        return dashboard_context
    if name == "sample_ops_metrics":
        from specops.ops.gauges import sample_ops_metrics

        return sample_ops_metrics
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
