"""Tenant quotas on generations: past a tenant's limit of queued and running generations a
submission is a 429 naming the limit, with Retry-After, in both APIs, and nothing is written or
enqueued. The default comes from settings, a tenant's own limit (set in the admin) wins."""
from __future__ import annotations

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from metadata.models import LIVE_STATUSES, Session, SessionStatus, Tenant, TenantMembership
from tests.helpers import queued_messages

REST = "/api/v1/generations/"
OPENAI = "/v1/completions"
pytestmark = pytest.mark.django_db


def rest(client: APIClient):
    return client.post(REST, {"prompt": "import os\n", "max_new_tokens": 4, "temperature": 0.7}, format="json")


def openai(client: APIClient, model: str):
    return client.post(OPENAI, {"model": model, "prompt": "import os\n", "max_tokens": 4, "temperature": 0.7},
                       format="json")




def client_of(name: str) -> APIClient:
    tenant = Tenant.objects.create(name=name)
    user = get_user_model().objects.create_user(f"user-{name}")
    TenantMembership.objects.create(user=user, tenant=tenant)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def test_past_its_own_limit_a_tenant_gets_a_429_in_both_apis_and_nothing_is_written_or_enqueued(
        api_client, tenant, tiny_model):
    tenant.max_live_generations = 2
    tenant.save()
    assert rest(api_client).status_code == 202 and openai_started(api_client, tiny_model.name)
    before = queued_messages(tiny_model.queue)

    refused = rest(api_client)
    assert refused.status_code == 429 and refused["Retry-After"] == "2"
    body = refused.json()
    assert body["status"] == 429
    assert "max_live_generations=2" in body["detail"] and "2 generations queued or running" in body["detail"]
    assert "the tenant's own max_live_generations" in body["detail"]

    refused = openai(api_client, tiny_model.name)
    assert refused.status_code == 429 and refused["Retry-After"] == "2"
    error = refused.json()["error"]
    assert error["code"] == "quota_exceeded" and "max_live_generations=2" in error["message"]

    assert Session.objects.count() == 2 and queued_messages(tiny_model.queue) == before


def openai_started(client: APIClient, model: str) -> bool:
    """Submit a non-streaming /v1/ request without waiting for it (the in-process client would wait
    for the worker): the session row is what counts against the quota."""
    from inference.api.serializers import GenerationRequestSerializer
    from sessions.submission import submit_generation

    tenant = Tenant.objects.get(name="acme")
    serializer = GenerationRequestSerializer(data={"model": model, "prompt": "x = 1\n", "max_new_tokens": 4,
                                                   "temperature": 0.7})
    assert serializer.is_valid(), serializer.errors
    return submit_generation(serializer, tenant, None).status == SessionStatus.QUEUED


def test_the_default_comes_from_settings_and_ended_sessions_free_their_place(api_client, tenant, tiny_model,
                                                                              settings):
    settings.SPECOPS_TENANT_MAX_LIVE_GENERATIONS = 1
    assert rest(api_client).status_code == 202
    refused = rest(api_client)
    assert refused.status_code == 429
    assert "max_live_generations=1, SPECOPS_TENANT_MAX_LIVE_GENERATIONS" in refused.json()["detail"]

    Session.objects.filter(tenant=tenant).update(status=SessionStatus.SUCCEEDED)
    assert rest(api_client).status_code == 202
    Session.objects.filter(tenant=tenant, status=SessionStatus.QUEUED).update(status=SessionStatus.RUNNING)
    assert rest(api_client).status_code == 429  # running counts as queued does

    tenant.max_live_generations = 0  # the tenant's own: no limit
    tenant.save()
    assert rest(api_client).status_code == 202 and rest(api_client).status_code == 202


def test_one_tenant_at_its_limit_does_not_hold_up_another(api_client, tenant, tiny_model, settings):
    settings.SPECOPS_TENANT_MAX_LIVE_GENERATIONS = 1
    assert rest(api_client).status_code == 202 and rest(api_client).status_code == 429
    other = client_of("globex")
    assert rest(other).status_code == 202
    live = Session.objects.filter(status__in=LIVE_STATUSES)
    assert live.filter(tenant=tenant).count() == 1 and live.filter(tenant__name="globex").count() == 1


def test_the_count_reads_the_partial_index_of_live_sessions_by_tenant(tenant, tiny_model):
    """The count must not read a tenant's finished sessions: on every partition the planner takes
    the partial index of live sessions by tenant (migration 0015), not the tenant-recent index and
    a filter (checked with sequential scans off: the test tables are tiny, and a sequential scan of
    an empty table is always cheapest)."""
    sql, params = Session.objects.filter(tenant=tenant, status__in=[SessionStatus.QUEUED, SessionStatus.RUNNING]) \
        .values("pk").query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname FROM pg_indexes WHERE tablename LIKE 'metadata_session%%' "
                       "AND indexdef LIKE '%%(tenant_id) WHERE%%status%%'")
        partial = {row[0] for row in cursor.fetchall()}
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN SELECT COUNT(*) FROM ({sql}) AS live", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert partial and "tenant_id_created_at" not in plan, plan
    assert all(name in plan for name in partial - {"session_tenant_live"}), plan  # one per partition


def test_an_operator_sets_a_tenants_quotas_in_the_admin(client, tenant):
    admin = get_user_model().objects.create_superuser("root", password="pw-root-123")
    client.force_login(admin)
    listing = client.get("/admin/metadata/tenant/")
    assert listing.status_code == 200 and "64 (default)" in listing.content.decode()
    changed = client.post(f"/admin/metadata/tenant/{tenant.pk}/change/",
                          {"name": "acme", "max_live_generations": "5", "max_open_streams": "0",
                           "created_at_0": "2026-01-01", "created_at_1": "00:00:00"})
    assert changed.status_code == 302, changed.content.decode()[:2000]
    tenant.refresh_from_db()
    assert tenant.live_generation_limit() == 5 and tenant.open_stream_limit() == 0
    assert "no limit" in client.get("/admin/metadata/tenant/").content.decode()
