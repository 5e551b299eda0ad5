"""Least privilege in the REST API: who may promote, which versions a tenant sees, what a failed
session tells a tenant, and two promotions of one name at once (serialised, never a 500)."""
from __future__ import annotations

import threading
import time

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connections, transaction
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from metadata.models import ModelVersion
from inference.registry import register_version
from metadata.models import Session, SessionStatus, TenantMembership
from metadata.replicas import lsn

RAW_ERROR = "ConnectionError: Error 111 connecting to 127.0.0.1:6379. Connection refused."


def client_of(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def staff(name: str, *, promoter: bool, tenant=None):
    user = get_user_model().objects.create_user(name, password="pw-staff-123", is_staff=True)
    if promoter:
        user.user_permissions.add(Permission.objects.get(codename="change_modelversion"))
    if tenant is not None:
        TenantMembership.objects.create(user=user, tenant=tenant)
    return user


@pytest.mark.django_db
def test_promotion_needs_the_model_permission_not_only_staff(tiny_model):
    newer = register_version("tiny", "2", "target", tiny_model.directory)
    url = f"/api/v1/models/{newer.pk}/promote/"
    response = client_of(staff("bob", promoter=False)).post(url)
    assert response.status_code == 403 and "metadata.change_modelversion" in response.json()["detail"]
    newer.refresh_from_db()
    assert newer.status == "staged"
    response = client_of(staff("carol", promoter=True)).post(url)
    assert response.status_code == 200 and response.json()["replaced"] == [tiny_model.pk]


@pytest.mark.django_db
def test_tenants_see_only_active_versions(api_client, tiny_model):
    staged = register_version("tiny", "2", "target", tiny_model.directory)
    listed = {m["id"] for m in api_client.get("/api/v1/models/").json()}
    assert tiny_model.pk in listed and staged.pk not in listed
    assert api_client.get(f"/api/v1/models/{staged.pk}/").status_code == 404
    assert client_of(staff("bob", promoter=False)).get(f"/api/v1/models/{staged.pk}/").status_code == 404
    every = {m["id"] for m in client_of(staff("carol", promoter=True)).get("/api/v1/models/").json()}
    assert staged.pk in every and tiny_model.pk in every


@pytest.mark.django_db
def test_a_session_error_shows_tenants_a_stable_message_and_staff_the_detail(api_client, tenant, tiny_model):
    session = Session.objects.create(tenant=tenant, target=tiny_model, drafter="ngram", queue="cpu", prompt="x",
                                     prompt_tokens=1, params={}, status=SessionStatus.FAILED, error=RAW_ERROR)
    seen = api_client.get(f"/api/v1/sessions/{session.pk}/").json()
    assert (seen["error"], seen["error_code"]) == ("generation failed", "worker_error")
    assert RAW_ERROR not in str(api_client.get("/api/v1/sessions/").json())
    seen = client_of(staff("dave", promoter=False, tenant=tenant)).get(f"/api/v1/sessions/{session.pk}/").json()
    assert (seen["error"], seen["error_code"]) == (RAW_ERROR, "worker_error")
    session.refresh_from_db()
    assert session.error == RAW_ERROR  # what is stored is unchanged


@pytest.mark.django_db(transaction=True)
def test_concurrent_promotions_of_one_name_serialise(tiny_model):
    """Two promotions wait on the same lock, then run one after the other: both 200, one active."""
    versions = [register_version("tiny", str(n), "target", tiny_model.directory) for n in (2, 3)]
    promoter = staff("carol", promoter=True)
    key = Token.objects.create(user=promoter).key
    answers: dict[int, int] = {}

    def promote(version: ModelVersion) -> None:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
        try:
            with lsn.primary_only():  # as the test's own thread reads (tests/conftest.py)
                answers[version.pk] = client.post(f"/api/v1/models/{version.pk}/promote/").status_code
        finally:
            connections.close_all()

    threads = [threading.Thread(target=promote, args=(version,)) for version in versions]
    with transaction.atomic():  # hold the active version's row: both promotions queue behind it
        ModelVersion.objects.select_for_update().filter(pk=tiny_model.pk).first()
        for thread in threads:
            thread.start()
        time.sleep(1.0)
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(answers.values()) == [200, 200], answers
    active = ModelVersion.objects.filter(name="tiny", role="target", status="active")
    assert active.count() == 1 and active.get().pk in {v.pk for v in versions}


@pytest.mark.django_db
def test_the_openai_models_list_shows_active_targets_only(api_client, tenant, tiny_model):
    register_version("staged-only", "1", "target", tiny_model.directory)
    staged = register_version("tiny", "2", "target", tiny_model.directory)
    promoter = client_of(staff("carol", promoter=True, tenant=tenant))  # the /v1/ API needs a tenant
    for client in (api_client, promoter):
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
        assert client.get("/v1/models/staged-only").status_code == 404
        assert client.get(f"/v1/models/tiny:{staged.version}").status_code == 404
