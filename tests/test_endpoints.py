"""The operator-facing endpoints: OpenAPI, metrics, admin."""
from __future__ import annotations

import pytest


@pytest.mark.django_db
def test_openapi_schema_lists_the_api(api_client):
    response = api_client.get("/api/schema/")
    assert response.status_code == 200
    body = response.content.decode()
    for path in ("/api/v1/generations/", "/api/v1/sessions/{id}/", "/api/v1/sessions/{id}/tokens/"):
        assert path in body
    assert api_client.get("/api/schema/").content.decode() == body  # built once, served again


@pytest.mark.django_db
def test_the_schema_and_the_docs_need_a_signed_in_caller(client, admin_client):
    for url in ("/api/schema/", "/api/docs/"):
        response = client.get(url, HTTP_X_FORWARDED_FOR="203.0.113.7")
        assert response.status_code == 401, (url, response.status_code)
    assert admin_client.get("/api/schema/").status_code == 200  # the browser: the admin's session


@pytest.mark.django_db
def test_swagger_ui_is_served_from_the_installed_package(admin_client):
    page = admin_client.get("/api/docs/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js" in html
    assert "cdn" not in html.lower() and "@latest" not in html


@pytest.mark.django_db
def test_metrics_expose_django_counters(client, settings):
    settings.SPECOPS_METRICS_TOKEN = "t"  # core.metrics_view (tests/test_metrics_token.py)
    client.get("/api/schema/")
    body = client.get("/metrics", HTTP_AUTHORIZATION="Bearer t").content.decode()
    assert "django_http_requests_total_by_method_total" in body


@pytest.mark.django_db
def test_admin_lists_sessions(admin_client, tenant, tiny_model):
    from metadata.models import Session

    session = Session.objects.create(tenant=tenant, target=tiny_model, drafter="ngram", queue="cpu",
                                     prompt="x", prompt_tokens=1)
    response = admin_client.get("/admin/metadata/session/")
    assert response.status_code == 200
    assert str(session.pk) in response.content.decode()
