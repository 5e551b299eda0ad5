"""``Idempotency-Key`` on generation POSTs, in both APIs: a retry gets the first try's session.

Same key, same caller, same body: the same session, answered as the first was (no second
generation). Same key, another body: a 422 naming the header. Keys are per caller, bounded in
length, released when their request is refused, forgotten after a day; concurrent retries race
on a unique constraint, so exactly one session is made.
"""
from __future__ import annotations

import re
import threading
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from inference.idempotency import HEADER, REPLAYED_HEADER
from inference.limits import MAX_IDEMPOTENCY_KEY_CHARS
from inference.models import IdempotencyKey
from inference.tasks import reconcile_sessions
from metadata.models import Session, TenantMembership

URL = "/api/v1/generations/"
BODY = {"prompt": "import os\n", "max_new_tokens": 4}
META = "HTTP_IDEMPOTENCY_KEY"


@pytest.fixture(autouse=True)
def empty_cpu_queue():
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    broker.delete("cpu")
    yield
    broker.delete("cpu")


def post(client, key: str | None = "retry-1", body: dict = BODY, path: str = URL):
    extra = {META: key} if key is not None else {}
    return client.post(path, body, format="json", **extra)


@pytest.mark.django_db
def test_a_retry_with_the_key_answers_what_the_first_try_did(api_client, tiny_model):
    first, again = post(api_client), post(api_client)
    assert first.status_code == again.status_code == 202, again.content
    assert again.json()["id"] == first.json()["id"] and again["Location"] == first["Location"]
    assert again[REPLAYED_HEADER] == "true" and not first.has_header(REPLAYED_HEADER)
    assert Session.objects.count() == 1


@pytest.mark.django_db
def test_without_a_key_a_retry_is_a_second_generation(api_client, tiny_model):
    assert post(api_client, None).json()["id"] != post(api_client, None).json()["id"]


@pytest.mark.django_db
def test_the_key_with_another_body_is_a_422_naming_the_header(api_client, tiny_model):
    post(api_client)
    response = post(api_client, body={**BODY, "max_new_tokens": 5})
    assert response.status_code == 422
    assert "different request body" in response.json()[HEADER][0]
    assert Session.objects.count() == 1


@pytest.mark.django_db
def test_keys_belong_to_their_caller(api_client, tiny_model, tenant):
    other = get_user_model().objects.create_user("bob", password="pw-bob-12345")
    TenantMembership.objects.create(user=other, tenant=tenant)
    bob = APIClient()
    bob.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=other).key}")
    assert post(api_client).json()["id"] != post(bob).json()["id"]
    assert Session.objects.count() == 2


@pytest.mark.django_db
@pytest.mark.parametrize("key", ["", "k" * (MAX_IDEMPOTENCY_KEY_CHARS + 1), "caf\u00e9", "tab\there"])
def test_a_malformed_key_is_a_400_naming_the_header(api_client, tiny_model, key):
    response = post(api_client, key)
    assert response.status_code == 400
    assert f"1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII" in response.json()[HEADER][0]
    assert not Session.objects.exists()


@pytest.mark.django_db
def test_a_refused_request_releases_its_key(api_client, tiny_model):
    refused = post(api_client, body={**BODY, "max_new_tokens": 0})
    assert refused.status_code == 400 and not IdempotencyKey.objects.exists()
    assert post(api_client).status_code == 202  # the key is free for the corrected request


@pytest.mark.django_db
def test_an_expired_key_is_forgotten_and_purged(api_client, tiny_model, tenant):
    first = post(api_client).json()["id"]
    IdempotencyKey.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    second = post(api_client)
    assert second.status_code == 202 and second.json()["id"] != first
    IdempotencyKey.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert reconcile_sessions()["keys_expired"] == 1
    assert not IdempotencyKey.objects.exists()


@pytest.mark.django_db
def test_a_claim_whose_request_never_completed_is_taken_over(api_client, tiny_model):
    post(api_client)
    IdempotencyKey.objects.update(session_id=None, status_code=None)  # as a web process that died left it
    assert post(api_client).status_code == 409  # while it may still be under way
    IdempotencyKey.objects.update(created_at=timezone.now() - timedelta(minutes=5))
    assert post(api_client).status_code == 202
    assert Session.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_concurrent_retries_make_one_session(api_user, tiny_model):
    key = Token.objects.create(user=api_user).key
    answers: list[tuple[int, str | None]] = []
    start = threading.Barrier(6)

    def retry() -> None:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
        start.wait()
        try:
            response = post(client, "race")
            answers.append((response.status_code, response.json().get("id")))
        finally:
            connection.close()

    threads = [threading.Thread(target=retry) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(answers) == 6 and {code for code, _ in answers} <= {202, 409}
    assert len({session for code, session in answers if code == 202}) == 1
    assert Session.objects.count() == 1


@pytest.fixture
def openai_client(api_user, settings) -> Client:
    settings.SPECOPS_OPENAI_TIMEOUT_S = 0.05  # no worker runs: each wait ends at once (504)
    return Client(HTTP_AUTHORIZATION=f"Bearer {Token.objects.create(user=api_user).key}")


def session_of(response) -> str:
    return re.search(r"as session ([0-9a-f-]{36})", response.json()["error"]["message"]).group(1)


@pytest.mark.django_db
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "import os\n", "max_tokens": 4}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
])
def test_the_openai_api_answers_a_retry_from_the_first_session(openai_client, tiny_model, path, body):
    first = openai_client.post(path, body, content_type="application/json", **{META: "openai-1"})
    again = openai_client.post(path, body, content_type="application/json", **{META: "openai-1"})
    assert first.status_code == again.status_code == 504  # no worker: the generation goes on
    assert session_of(first) == session_of(again)
    assert Session.objects.count() == 1
    other = {**body, "max_tokens": 5}
    response = openai_client.post(path, other, content_type="application/json", **{META: "openai-1"})
    assert response.status_code == 422 and HEADER in response.json()["error"]["message"]
    response = openai_client.post(path, body, content_type="application/json", **{META: "x" * 300})
    assert response.status_code == 400 and HEADER in response.json()["error"]["message"]
    assert Session.objects.count() == 1


@pytest.mark.django_db
def test_an_openai_retry_of_a_finished_session_replays_its_reply(openai_client, tiny_model, settings):
    body = {"model": "tiny", "prompt": "import os\n", "max_tokens": 4}
    openai_client.post("/v1/completions", body, content_type="application/json", **{META: "done-1"})
    session = Session.objects.get()
    Session.objects.filter(pk=session.pk).update(status="succeeded", text="print(1)", token_count=3,
                                                 finish_reason="length", finished_at=timezone.now())
    settings.SPECOPS_OPENAI_TIMEOUT_S = 10  # the replay reads the session's end from its row
    again = openai_client.post("/v1/completions", body, content_type="application/json", **{META: "done-1"})
    assert again.status_code == 200, again.content
    assert again[REPLAYED_HEADER] == "true" and again["X-SpecOps-Session"] == str(session.pk)
    assert again.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.django_db
def test_a_keyed_multipart_post_with_the_admins_session_and_its_csrf_check(api_user, tiny_model):
    """The CSRF check reads a multipart body before the view (its stream is gone): the key's
    fingerprint comes from its fields, and the retry is still answered from the first session."""
    client = Client(enforce_csrf_checks=True)
    client.force_login(api_user)
    client.get("/admin/login/")  # a CSRF cookie
    token = client.cookies["csrftoken"].value
    body = {"prompt": "import os\n", "max_new_tokens": "4"}
    first = client.post(URL, body, HTTP_X_CSRFTOKEN=token, **{META: "form-1"})
    again = client.post(URL, body, HTTP_X_CSRFTOKEN=token, **{META: "form-1"})
    assert first.status_code == again.status_code == 202, again.content
    assert first.json()["id"] == again.json()["id"] and Session.objects.count() == 1
