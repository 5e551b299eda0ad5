"""The operators' dashboard: rollups written on request-log write and by the rollup job, read by the page."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from core import histograms
from metadata.models import (
    CacheStatsSnapshot,
    RequestLog,
    Session,
)
from ops.models import OpsRollup, RollupWidth
from ops.request_rollups import rollup_buffer
from ops.rollups import backfill_api, roll_up


def finished_session(tenant, model, drafter="tree", ended_ago=timedelta(seconds=5), **stats) -> Session:
    now = timezone.now()
    base = {"drafter": drafter, "steps": 4, "drafted": 12, "accepted": 9, "drafted_per_position": [4, 4, 4],
            "accepted_per_position": [4, 3, 2], "draft_seconds": 0.1, "verify_seconds": 0.2,
            "batch_rows_max": 3, "ttft_seconds": 0.25, "itl_seconds": 0.02}
    return Session.objects.create(
        tenant=tenant, target=model, drafter=drafter, queue="cpu", prompt="x", prompt_tokens=1, status="succeeded",
        token_count=13, created_at=now - ended_ago - timedelta(seconds=2), started_at=now - ended_ago - timedelta(seconds=1),
        finished_at=now - ended_ago, stats={**base, **stats})


def test_histogram_quantiles_merge():
    first, second = histograms.empty(), histograms.empty()
    for ms in (10, 20, 30):
        histograms.observe(first, ms)
    histograms.observe(second, 900)
    merged = histograms.merge([first, second])
    assert sum(merged) == 4
    assert 600 <= histograms.quantile(merged, 0.99) <= 1000  # 900 ms lies in [800, 1000)
    assert histograms.quantile(histograms.empty(), 0.5) is None


@pytest.mark.django_db
def test_api_requests_are_rolled_up_on_write(api_client, tiny_model):
    rollup_buffer.flush()
    # Rows committed by earlier live-server tests in this minute are not this test's (rolled back after it).
    OpsRollup.objects.filter(series="api").delete()
    RequestLog.objects.all().delete()
    for _ in range(3):
        api_client.get("/api/v1/sessions/")
    api_client.post("/api/v1/generations/", {}, format="json")  # a 400
    rollup_buffer.flush()
    rows = {row.key: row for row in OpsRollup.objects.filter(series="api", width=RollupWidth.MINUTE)}
    assert rows["2xx"].count == 3 and rows["4xx"].count == 1
    assert sum(rows["2xx"].buckets) == 3 and rows["2xx"].total > 0
    # a second flush adds to the same minute (several processes do), never replaces
    api_client.get("/api/v1/sessions/")
    rollup_buffer.flush()
    assert OpsRollup.objects.get(series="api", key="2xx", width=RollupWidth.MINUTE).count in (4, 1)  # a new minute
    assert RequestLog.objects.count() == 5  # the raw log keeps every request


@pytest.mark.django_db
def test_the_rollup_job_aggregates_sessions_caches_and_samples_and_is_idempotent(tenant, tiny_model):
    finished_session(tenant, tiny_model, "tree")
    finished_session(tenant, tiny_model, "tree")
    finished_session(tenant, tiny_model, "ngram", accepted=3, accepted_per_position=[2, 1, 0])
    CacheStatsSnapshot.objects.create(cache="session_state", tier="local", hits=90, misses=10)

    first = roll_up()
    assert first.sessions == 3 and not first.skipped
    snapshot = sorted(OpsRollup.objects.filter(width=RollupWidth.MINUTE).exclude(series__in=(
        "_progress", "queue_depth", "default_rows", "replica_lag", "db_xacts")).values_list("series", "key", "count"))
    roll_up()  # again: aggregated series are replaced, not added
    again = sorted(OpsRollup.objects.filter(width=RollupWidth.MINUTE).exclude(series__in=(
        "_progress", "queue_depth", "default_rows", "replica_lag", "db_xacts")).values_list("series", "key", "count"))
    assert snapshot == again

    tree = OpsRollup.objects.get(width=RollupWidth.MINUTE, series="generation", key="tree")
    assert tree.count == 2 and tree.values["accepted"] == 18 and tree.values["accepted_per_position"] == [8, 6, 4]
    assert OpsRollup.objects.get(width=RollupWidth.MINUTE, series="ttft", key="tree").count == 2
    assert OpsRollup.objects.get(width=RollupWidth.MINUTE, series="cache", key="session_state/local").values["hits"] == 90
    assert OpsRollup.objects.filter(width=RollupWidth.MINUTE, series="queue_depth", key="cpu").exists()
    assert OpsRollup.objects.get(width=RollupWidth.MINUTE, series="default_rows",
                                 key="metadata_request_log").values["max"] == 0
    hour = OpsRollup.objects.get(width=RollupWidth.HOUR, series="generation", key="tree")
    assert hour.count == 2 and hour.values["drafted"] == 24  # the hour is re-merged from its minutes


@pytest.mark.django_db
def test_backfill_from_the_raw_log_matches_the_raw_percentiles(tenant):
    now = timezone.now().replace(second=30)
    for ms in list(range(1, 101)):
        RequestLog.objects.create(requested_at=now, method="GET", path="/api/v1/x/", status_code=200, duration_ms=ms)
    minute = now.replace(second=0, microsecond=0)
    backfill_api(minute, minute + timedelta(minutes=1))
    row = OpsRollup.objects.get(series="api", key="2xx", width=RollupWidth.MINUTE, start=minute)
    assert row.count == 100 and row.total == pytest.approx(5050)
    assert 75 <= histograms.quantile(row.buckets, 0.95) <= 100  # raw p95 = 95.05, in the [75, 100) bucket


@pytest.mark.django_db
def test_dashboard_draws_charts_from_rollups_without_scanning_raw_rows(admin_client, api_client, tenant, tiny_model):
    for ms in range(3):
        api_client.get("/api/v1/sessions/")
    rollup_buffer.flush()
    finished_session(tenant, tiny_model, "tree")
    CacheStatsSnapshot.objects.create(cache="session_state", tier="local", hits=90, misses=10)
    roll_up()

    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get("/admin/dashboard/")
    assert page.status_code == 200
    html = page.content.decode()
    for sql in (q["sql"] for q in queries.captured_queries):
        assert "metadata_request_log" not in sql, sql
        assert "metadata_session" not in sql or "IN ('queued', 'running')" in sql.replace('"', "'"), sql
    charts = re.findall(r'<svg[^>]*class="chart" data-points="(\d+)"', html)
    assert len(charts) >= 12
    assert "SLO p95 300 ms" in html and "SLO p95 1000 ms" in html and "SLO p95 100 ms" in html
    assert "0.750" in html  # tree acceptance 9/12
    assert "per-position acceptance" in html and 'data-drafter="tree"' in html
    assert "tiny" in html  # active models table
    generations = re.search(r'aria-label="Generations per minute \(all drafters\)"', html)
    assert generations is not None

    panels = admin_client.get("/admin/dashboard/?panels=1")
    assert panels.status_code == 200 and "no-store" in panels["Cache-Control"]
    fragment = panels.content.decode()
    assert fragment.lstrip().startswith('<div class="ops-panels"') and "<html" not in fragment


@pytest.mark.django_db
def test_dashboard_says_when_the_rollups_are_stale(admin_client):
    html = admin_client.get("/admin/dashboard/").content.decode()
    assert "The rollups are empty" in html and "ops.roll_up_ops" in html
    roll_up()
    html = admin_client.get("/admin/dashboard/").content.decode()
    assert "The rollups are" not in html


@pytest.mark.django_db
def test_api_requests_are_logged_with_their_latency(api_client, tiny_model):
    api_client.get("/api/v1/sessions/")
    api_client.post("/api/v1/generations/", {}, format="json")
    logged = list(RequestLog.objects.order_by("requested_at").values_list("method", "status_code"))
    assert logged == [("GET", 200), ("POST", 400)]
    assert RequestLog.objects.filter(duration_ms__gt=0, tenant__isnull=False).count() == 2


def test_dashboard_needs_staff(client):
    response = client.get("/admin/dashboard/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


@pytest.mark.django_db
def test_the_model_registry_charts_each_pairs_acceptance_from_the_hourly_rollups(admin_client, tiny_model):
    """The ops app draws the chart from its rollups and plugs it into the registry's pages (ops.admin)."""
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    OpsRollup.objects.create(start=hour, width=RollupWidth.HOUR, series="pair", key=f"{tiny_model.pk}:none",
                             count=2, values={"drafted": 8, "accepted": 6})
    listing = admin_client.get("/admin/metadata/modelversion/").content.decode()
    assert "Acceptance of each model pair, hourly, last 7 days" in listing
    assert f"tiny:{tiny_model.version} + no draft" in listing and "75" in listing
    page = admin_client.get(f"/admin/metadata/modelversion/{tiny_model.pk}/change/").content.decode()
    assert "Acceptance of this target&#x27;s pairs" in page or "Acceptance of this target's pairs" in page
    assert f"tiny:{tiny_model.version} + no draft" in page
