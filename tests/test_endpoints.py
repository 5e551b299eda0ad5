"""The operator-facing endpoints: OpenAPI, metrics, admin."""
from __future__ import annotations

import pytest


@pytest.mark.django_db
def test_openapi_schema_lists_the_api(client):
    response = client.get("/api/schema/")
    assert response.status_code == 200
    body = response.content.decode()
    for path in ("/api/v1/generations/", "/api/v1/sessions/{id}/", "/api/v1/sessions/{id}/tokens/"):
        assert path in body


@pytest.mark.django_db
def test_swagger_ui_is_served(client):
    assert client.get("/api/docs/").status_code == 200


@pytest.mark.django_db
def test_metrics_expose_django_counters(client):
    client.get("/api/schema/")
    body = client.get("/metrics").content.decode()
    assert "django_http_requests_total_by_method_total" in body


@pytest.mark.django_db
def test_admin_lists_sessions(admin_client, tenant, tiny_model):
    from metadata.models import Session

    session = Session.objects.create(tenant=tenant, target=tiny_model, drafter="ngram", queue="cpu",
                                     prompt="x", prompt_tokens=1)
    response = admin_client.get("/admin/metadata/session/")
    assert response.status_code == 200
    assert str(session.pk) in response.content.decode()
