"""POST /api/v1/generations/ and GET /api/v1/sessions/{id}/: validation, auth, tenancy."""
from __future__ import annotations

import uuid

import pytest
import redis
from django.conf import settings
from rest_framework.test import APIClient

from metadata.models import Session, Tenant

URL = "/api/v1/generations/"


def queued_messages(queue: str = "cpu") -> int:
    return redis.Redis.from_url(settings.CELERY_BROKER_URL).llen(queue)


@pytest.fixture(autouse=True)
def empty_cpu_queue():
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete("cpu")


@pytest.mark.django_db
def test_no_token_is_401(tiny_model):
    assert APIClient().post(URL, {"prompt": "x"}, format="json").status_code == 401
    bad = APIClient()
    bad.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")
    assert bad.get(f"/api/v1/sessions/{uuid.uuid4()}/").status_code == 401


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, field, rule",
    [
        ({}, "prompt", "required"),
        ({"prompt": "def f():", "max_new_tokens": 0}, "max_new_tokens", "greater than or equal to 1"),
        ({"prompt": "def f():", "max_new_tokens": "many"}, "max_new_tokens", "valid integer"),
        ({"prompt": "def f():", "temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"prompt": "def f():", "top_p": 0}, "top_p", "greater than 0"),
        ({"prompt": "def f():", "drafter": "magic"}, "drafter", "not a valid choice"),
        ({"prompt": "def f():", "draft_length": 9}, "draft_length", "less than or equal to 8"),
        ({"prompt": "def f():", "model": "nope"}, "model", "no active target model named 'nope'"),
        ({"prompt": "def f():", "stop": ["a", "b", "c", "d", "e"]}, "stop", "no more than 4"),
    ],
)
def test_bad_input_is_400_naming_field_and_rule(api_client, tiny_model, body, field, rule):
    response = api_client.post(URL, body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert rule in " ".join(map(str, response.json()[field]))
    assert Session.objects.count() == 0
    assert queued_messages() == 0


@pytest.mark.django_db
def test_prompt_longer_than_the_context_is_400_and_leaves_nothing(api_client, tiny_model):
    prompt = "def f(x):\n    return x\n" * 2000  # far beyond the tiny model's 1024 positions
    response = api_client.post(URL, {"prompt": prompt}, format="json")
    assert response.status_code == 400
    assert "accepts at most 1024 tokens" in response.json()["prompt"][0]
    assert Session.objects.count() == 0
    assert queued_messages() == 0


@pytest.mark.django_db
def test_accepted_request_writes_a_session_and_enqueues_on_the_model_queue(api_client, tiny_model):
    response = api_client.post(URL, {"prompt": "import os\n", "max_new_tokens": 8}, format="json")
    assert response.status_code == 202, response.content
    body = response.json()
    session = Session.objects.get(pk=body["id"])
    assert session.status == "queued" and session.queue == "cpu" and session.drafter == "draft_model"
    assert session.params["max_new_tokens"] == 8 and session.prompt_tokens > 0
    assert body["url"].endswith(f"/api/v1/sessions/{session.pk}/")
    assert response["Location"] == body["url"]
    assert queued_messages("cpu") == 1


@pytest.mark.django_db
def test_sessions_are_tenant_scoped_and_unknown_is_404(api_client, tiny_model):
    created = api_client.post(URL, {"prompt": "import os\n"}, format="json").json()
    assert api_client.get(f"/api/v1/sessions/{created['id']}/").json()["status"] == "queued"
    assert api_client.get(f"/api/v1/sessions/{uuid.uuid4()}/").status_code == 404

    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    from metadata.models import TenantMembership

    other = get_user_model().objects.create_user("mallory")
    TenantMembership.objects.create(user=other, tenant=Tenant.objects.create(name="other"))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=other).key}")
    assert client.get(f"/api/v1/sessions/{created['id']}/").status_code == 404
    assert client.get("/api/v1/sessions/").json()["results"] == []


@pytest.mark.django_db
def test_model_promotion_needs_an_operator(api_client, tiny_model, admin_client):
    assert api_client.post(f"/api/v1/models/{tiny_model.pk}/promote/").status_code == 403
    listed = api_client.get("/api/v1/models/").json()
    assert {(m["name"], m["role"], m["status"]) for m in listed} == {("tiny", "target", "active"),
                                                                      ("tiny", "draft", "active")}
    from inference.registry import register_version

    newer = register_version("tiny", "2", "target", tiny_model.directory)
    response = admin_client.post(f"/api/v1/models/{newer.pk}/promote/")
    assert response.status_code == 200 and response.json()["replaced"] == [tiny_model.pk]
    tiny_model.refresh_from_db()
    assert tiny_model.status == "retired"
