"""The numbers behind the operators' dashboard: sessions, latency vs SLO, acceptance, caches."""
from __future__ import annotations

from datetime import timedelta

from django.db import connection
from django.db.models import Count
from django.utils import timezone

from inference.models import ModelVersion, VersionStatus
from metadata.models import (
    CacheStatsSnapshot,
    PartitionArchivalJob,
    RequestLog,
    Session,
)
from specops.conf import conf
from specops.ops.svg_charts import Series, bar_chart, line_chart

WINDOW = timedelta(hours=24)


def sessions_by_status(since) -> dict[str, int]:
    rows = Session.objects.filter(created_at__gte=since).values("status").annotate(n=Count("id"))
    return {row["status"]: row["n"] for row in rows}


def hourly_latency_percentiles(since) -> list[tuple[str, float, float, float, int]]:
    """(hour, p50, p95, p99 ms, requests) of API requests per hour, from the request log."""
    sql = f"""
        SELECT date_trunc('hour', requested_at) AS hour,
               percentile_cont(0.5) WITHIN GROUP (ORDER BY duration_ms),
               percentile_cont(0.95) WITHIN GROUP (ORDER BY duration_ms),
               percentile_cont(0.99) WITHIN GROUP (ORDER BY duration_ms), count(*)
        FROM {RequestLog._meta.db_table} WHERE requested_at >= %s GROUP BY 1 ORDER BY 1"""
    with connection.cursor() as cursor:
        cursor.execute(sql, [since])
        return [(hour.strftime("%H:00"), p50, p95, p99, n) for hour, p50, p95, p99, n in cursor.fetchall()]


def acceptance_by_drafter(since) -> list[tuple[str, float, float, int]]:
    """(drafter, mean acceptance rate, mean accepted length, sessions) of finished sessions."""
    sql = f"""
        SELECT drafter, avg((stats->>'acceptance_rate')::float), avg((stats->>'mean_accepted_length')::float),
               count(*)
        FROM {Session._meta.db_table}
        WHERE status = 'succeeded' AND created_at >= %s AND stats ? 'acceptance_rate'
        GROUP BY drafter ORDER BY drafter"""
    with connection.cursor() as cursor:
        cursor.execute(sql, [since])
        return cursor.fetchall()


def cache_hit_rate_series(limit: int = 48) -> list[Series]:
    colors = {"local": "#417690", "redis": "#e08e0b"}
    series = []
    for tier in ("local", "redis"):
        snapshots = list(CacheStatsSnapshot.objects.filter(tier=tier).order_by("-taken_at")[:limit])[::-1]
        points = [(s.taken_at.strftime("%H:%M"), s.hit_rate) for s in snapshots]
        series.append(Series(f"{tier} hit rate", points, colors[tier]))
    return series


def dashboard_context() -> dict:
    since = timezone.now() - WINDOW
    latency = hourly_latency_percentiles(since)
    p95 = Series("API p95 latency per hour (ms)", [(h, p) for h, _, p, _, _ in latency])
    p99 = Series("API p99 latency per hour (ms)", [(h, p) for h, _, _, p, _ in latency], "#79aec8")
    hit_series = cache_hit_rate_series()
    return {
        "sessions_by_status": sessions_by_status(since),
        "latency_rows": latency,
        "p95_chart": bar_chart(p95, " ms", ("SLO p95", conf.SLO_P95_MS)),
        "p99_chart": bar_chart(p99, " ms", ("SLO p99", conf.SLO_P99_MS)),
        "slo_p95": conf.SLO_P95_MS,
        "slo_p99": conf.SLO_P99_MS,
        "acceptance": acceptance_by_drafter(since),
        "cache_chart": line_chart(hit_series, "", top=1.0) if any(s.points for s in hit_series) else "",
        "archival_jobs": PartitionArchivalJob.objects.order_by("-updated_at")[:20],
        "active_models": ModelVersion.objects.filter(status=VersionStatus.ACTIVE).order_by("name", "role"),
    }
