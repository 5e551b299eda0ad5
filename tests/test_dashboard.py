"""The operators' dashboard: charts and tables from real rows."""
from __future__ import annotations

import pytest
from django.utils import timezone

from metadata.models import CacheStatsSnapshot, RequestLog, Session


@pytest.mark.django_db
def test_dashboard_draws_latency_against_the_slo_and_acceptance(admin_client, tenant, tiny_model):
    now = timezone.now()
    for ms in (10, 20, 30, 900):
        RequestLog.objects.create(requested_at=now, method="GET", path="/api/v1/sessions/", status_code=200,
                                  duration_ms=ms)
    Session.objects.create(tenant=tenant, target=tiny_model, drafter="tree", queue="cpu", prompt="x",
                           prompt_tokens=1, status="succeeded",
                           stats={"acceptance_rate": 0.75, "mean_accepted_length": 3.5})
    CacheStatsSnapshot.objects.create(cache="session_state", tier="local", hits=90, misses=10)
    CacheStatsSnapshot.objects.create(cache="session_state", tier="local", hits=80, misses=20)

    page = admin_client.get("/admin/dashboard/")
    assert page.status_code == 200
    html = page.content.decode()
    assert html.count('role="img"') == 3  # our charts: p95, p99, cache hit rates
    assert "SLO p95" in html and "0.750" in html and "tree" in html
    assert "tiny" in html  # active models table


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
