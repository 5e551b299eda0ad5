"""/metrics is for Prometheus: a bearer token (SPECOPS_METRICS_TOKEN), never anonymous in production."""
from __future__ import annotations

import pytest

TOKEN = "metrics-token-of-the-tests"


@pytest.fixture
def metrics_token(settings) -> str:
    settings.SPECOPS_METRICS_TOKEN = TOKEN
    return TOKEN


@pytest.mark.django_db
def test_a_scrape_with_the_token_gets_the_metrics_and_one_without_gets_a_401(client, metrics_token):
    client.get("/v1/models")  # a request, so the request counters have a sample
    for headers in ({}, {"HTTP_AUTHORIZATION": "Bearer wrong"}, {"HTTP_AUTHORIZATION": f"Token {TOKEN}"},
                    {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}x"}):
        response = client.get("/metrics", **headers)
        assert response.status_code == 401, headers
        assert response["WWW-Authenticate"].startswith("Bearer") and "SPECOPS_METRICS_TOKEN" in response.json()["detail"]
        assert b"django_http" not in response.content
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    assert "django_http_requests_total_by_method_total" in response.content.decode()


@pytest.mark.django_db
def test_without_a_token_metrics_are_served_only_with_debug_on(client, settings):
    settings.SPECOPS_METRICS_TOKEN = ""
    assert not settings.DEBUG  # the tests run as production does
    response = client.get("/metrics")
    assert response.status_code == 404 and b"django_http" not in response.content
    settings.DEBUG = True  # a developer's machine
    assert client.get("/metrics").status_code == 200
