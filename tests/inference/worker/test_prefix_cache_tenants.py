"""The prefix cache's trust boundary is the tenant, through a real worker (engine core, default
settings): tenant A sending what tenant B sent adopts nothing of B's (``cached_tokens`` 0, its
whole prompt prefilled: neither the count nor the time tells A that B sent it); B's own repeat
still adopts it; tenants an operator puts in one ``prefix_cache_group`` share their blocks."""
from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from inference.tokenizers import tokenizer_for
from metadata.models import Tenant, TenantMembership
from tests.helpers import wait_for
from tests.inference.worker.test_crash_safety import WORKER_ENV, generation, nonce_prompt
from tests.test_end_to_end import finished
from tests.worker_process import start_worker, stop_worker

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SECRET = "# the secret plan: merge with the competitor on friday, tell nobody\n" + "def plan(a, b):\n    return a + b\n\n" * 4


def client_of(name: str, group: str = "") -> APIClient:
    tenant = Tenant.objects.create(name=name, prefix_cache_group=group)
    user = get_user_model().objects.create_user(f"{name}-user")
    TenantMembership.objects.create(user=user, tenant=tenant)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def run(client: APIClient, prompt: str, max_new_tokens: int) -> dict:
    """A finished generation (each call its own max_new_tokens: the prediction cache never answers)."""
    session_id = generation(client, prompt, max_new_tokens)
    body = wait_for(lambda: finished(client, session_id), timeout=120, what=f"session {session_id}")
    assert body["status"] == "succeeded", body["error"]
    return body


def test_a_tenant_adopts_no_other_tenants_prefix_but_its_own_and_its_groups(api_client, tiny_model, tmp_path):
    tenant_b, tenant_a, tenant_c = api_client, client_of("tenant-a"), client_of("tenant-c")
    partner_1, partner_2 = client_of("partner-1", group="partners"), client_of("partner-2", group="partners")
    secret = nonce_prompt(SECRET)
    context = len(tokenizer_for(str(tiny_model.directory))(secret)["input_ids"])
    assert context >= 3 * 16, "the prompt must span whole blocks"
    worker = start_worker("cpu", "prefix-tenants", tmp_path / "worker.log", extra_env=WORKER_ENV)
    try:
        first_b = run(tenant_b, secret, 4)
        probe_a = run(tenant_a, secret, 5)
        again_b = run(tenant_b, secret, 6)
        # the OpenAI protocol's usage says the same to a tenant that has not sent it either
        openai_c = tenant_c.post("/v1/completions", {"model": tiny_model.name, "prompt": secret, "max_tokens": 3,
                                                     "temperature": 0}, format="json")
        shared = nonce_prompt(SECRET)
        run(partner_1, shared, 4)
        partner = run(partner_2, shared, 5)
    finally:
        stop_worker(worker)
    assert first_b["stats"]["cached_tokens"] == 0
    assert probe_a["stats"]["cached_tokens"] == 0, "tenant A was told B's prompt is cached"
    assert probe_a["stats"]["prefill_tokens"] == context  # and prefilled it whole: no faster first token
    assert again_b["stats"]["cached_tokens"] >= 16 * ((context - 1) // 16) > 0  # B's own blocks still serve B
    assert openai_c.status_code == 200, openai_c.content
    assert openai_c.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert partner["stats"]["cached_tokens"] > 0  # one group: one boundary
