"""Rate limits per token, per tenant and on generations: 429 with Retry-After in both APIs' shapes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis
from django.contrib.auth import get_user_model
from django.core.cache import cache
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from metadata.models import TenantMembership
from tests.core.test_configuration import ROOT


@pytest.fixture(autouse=True)
def fresh_counters(settings):
    """Counters are keyed by user and tenant ids, which restart with each test database."""
    cache.delete_pattern("throttle:*")
    settings.SPECOPS_THROTTLE_USER_RATE = "none"
    settings.SPECOPS_THROTTLE_TENANT_RATE = "none"
    settings.SPECOPS_THROTTLE_GENERATION_RATE = "none"
    yield
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete("cpu")


def client_for(user, keyword: str = "Token") -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"{keyword} {Token.objects.create(user=user).key}")
    return client


@pytest.mark.django_db
def test_per_token_limit_is_a_429_with_retry_after(api_client, settings):
    settings.SPECOPS_THROTTLE_USER_RATE = "3/min"
    assert [api_client.get("/api/v1/models/").status_code for _ in range(3)] == [200, 200, 200]

    refused = api_client.get("/api/v1/models/")

    assert refused.status_code == 429
    assert 1 <= int(refused["Retry-After"]) <= 60
    assert refused.json()["status"] == 429 and "throttled" in refused.json()["detail"]


@pytest.mark.django_db
def test_per_tenant_limit_counts_every_token_of_the_tenant(api_user, tenant, settings):
    settings.SPECOPS_THROTTLE_TENANT_RATE = "3/hour"
    bob = get_user_model().objects.create_user("bob", password="pw-bob-12345")
    TenantMembership.objects.create(user=bob, tenant=tenant)
    alice_client, bob_client = client_for(api_user), client_for(bob)

    codes = [c.get("/api/v1/sessions/").status_code for c in (alice_client, bob_client, alice_client, bob_client)]

    assert codes == [200, 200, 200, 429]


@pytest.mark.django_db
def test_generations_have_their_own_limit(api_client, tiny_model, settings):
    settings.SPECOPS_THROTTLE_GENERATION_RATE = "2/min"
    body = {"prompt": "import os\n", "max_new_tokens": 4}
    codes = [api_client.post("/api/v1/generations/", body, format="json").status_code for _ in range(3)]
    assert codes == [202, 202, 429]
    assert api_client.get("/api/v1/models/").status_code == 200  # reads are not generations


@pytest.mark.django_db
def test_openai_api_throttles_in_openai_shape(api_user, tiny_model, settings):
    settings.SPECOPS_THROTTLE_USER_RATE = "2/min"
    client = client_for(api_user, keyword="Bearer")
    assert [client.get("/v1/models").status_code for _ in range(2)] == [200, 200]

    refused = client.get("/v1/models")

    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "SPECOPS_THROTTLE_USER_RATE=2/min" in error["message"]

    settings.SPECOPS_THROTTLE_USER_RATE = "none"
    settings.SPECOPS_THROTTLE_GENERATION_RATE = "1/min"
    settings.SPECOPS_OPENAI_TIMEOUT_S = 0.3  # no worker runs here: the wait ends in a 504
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    waited = client.post("/v1/completions", body, format="json")
    assert waited.status_code == 504 and waited.json()["error"]["code"] == "timeout"
    assert client.post("/v1/completions", body, format="json").status_code == 429


def test_a_rate_that_does_not_parse_is_refused_at_start():
    result = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "SPECOPS_THROTTLE_USER_RATE": "lots"}, timeout=120, check=False)
    assert result.returncode != 0 and "SPECOPS_THROTTLE_USER_RATE='lots'" in result.stderr
