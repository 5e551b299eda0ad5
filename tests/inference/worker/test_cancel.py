"""POST /api/v1/sessions/{id}/cancel/: the caller's tenant only; queued ends now, running at its next step.

On the real services: the API in process, a real Celery worker (threads pool, one batching loop)
for the running case, the session's stream read back from the real Redis.
"""
from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from metadata.models import Session, Tenant, TenantMembership, TokenRecord
from sessions.streams import token_stream
from specops.celery import app
from tests.helpers import wait_for
from tests.worker_process import start_worker, stop_worker

pytestmark = pytest.mark.django_db(transaction=True)  # on_commit work (cache, stream) must run


def make_session(tenant, target, status="queued", **fields) -> Session:
    return Session.objects.create(tenant=tenant, target=target, drafter="ngram", queue="cancel-idle", prompt="x",
                                  prompt_tokens=1, status=status, params={"max_new_tokens": 8}, **fields)


def stream_events(session_id) -> list[tuple[str, str, dict]]:
    entries = token_stream.client().xrange(token_stream.stream_key(session_id))
    return [(i.decode(), f[b"event"].decode(), json.loads(f[b"data"])) for i, f in entries]


def cancel(client, session_id):
    return client.post(f"/api/v1/sessions/{session_id}/cancel/")


def test_a_queued_session_ends_at_once_with_its_done_event(api_client, tenant, tiny_model):
    session = make_session(tenant, tiny_model)
    assert api_client.get(f"/api/v1/sessions/{session.pk}/").json()["status"] == "queued"  # now cached

    response = cancel(api_client, session.pk)

    assert response.status_code == 200, response.content
    assert response.json()["status"] == "cancelled" and response.json()["finish_reason"] == "cancelled"
    session.refresh_from_db()
    assert session.status == "cancelled" and session.finished_at is not None
    assert api_client.get(f"/api/v1/sessions/{session.pk}/").json()["status"] == "cancelled"  # cache invalidated
    assert [(event, data["status"]) for _, event, data in stream_events(session.pk)] == [("done", "cancelled")]


def test_a_running_session_is_marked_and_left_to_its_worker(api_client, tenant, tiny_model):
    session = make_session(tenant, tiny_model, status="running")

    response = cancel(api_client, session.pk)

    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    session.refresh_from_db()
    assert session.finished_at is None  # the batching loop stops it and writes the end
    assert stream_events(session.pk) == []  # its worker publishes the done, after its last step


@pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled"])
def test_an_ended_session_is_a_409_naming_its_status(api_client, tenant, tiny_model, status):
    session = make_session(tenant, tiny_model, status=status)

    response = cancel(api_client, session.pk)

    assert response.status_code == 409
    assert response.json()["status"] == 409
    assert f"the session is already {status}" in response.json()["detail"]
    assert Session.objects.get(pk=session.pk).status == status
    assert stream_events(session.pk) == []


def test_another_tenants_session_is_a_404_and_stays_as_it_was(api_client, tiny_model):
    other = make_session(Tenant.objects.create(name="other"), tiny_model)

    assert cancel(api_client, other.pk).status_code == 404
    assert cancel(api_client, "00000000-0000-0000-0000-000000000000").status_code == 404
    assert cancel(api_client, "not-a-uuid").status_code == 404
    assert Session.objects.get(pk=other.pk).status == "queued"
    assert cancel(APIClient(), other.pk).status_code == 401
    stranger = get_user_model().objects.create_user("mallory", password="pw-mallory-123")
    outsider = APIClient()
    outsider.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=stranger).key}")
    assert cancel(outsider, other.pk).status_code == 404  # no tenant: nothing is visible
    TenantMembership.objects.create(user=stranger, tenant=Tenant.objects.create(name="third"))
    assert cancel(outsider, other.pk).status_code == 404
    assert Session.objects.get(pk=other.pk).status == "queued"


# ---- through a real worker ----------------------------------------------------------------------

MAX_NEW_TOKENS = 1000  # far more than the tiny model makes before the cancel lands


@pytest.fixture(scope="module")
def cpu_worker(django_db_setup, tmp_path_factory):
    app.control.purge()  # the tests' own broker database: nothing left from an earlier run runs here
    process = start_worker("cpu", "cancel-cpu", tmp_path_factory.mktemp("worker") / "worker.log",
                           extra_env={"SPECOPS_TOKEN_FLUSH_MS": "100", "OMP_NUM_THREADS": "1"})
    yield process
    stop_worker(process)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["tree", "none"])
def test_cancel_mid_generation_stops_the_worker_and_ends_the_stream(api_client, tiny_model, cpu_worker, drafter):
    created = api_client.post("/api/v1/generations/", {"prompt": "def parse(text):\n    ", "drafter": drafter,
                                                       "max_new_tokens": MAX_NEW_TOKENS}, format="json")
    assert created.status_code == 202, created.content
    session_id = created.json()["id"]
    wait_for(lambda: any(event == "tokens" for _, event, _ in stream_events(session_id)), timeout=120,
             what="the first streamed step")

    response = cancel(api_client, session_id)

    assert response.status_code == 200, response.content
    assert response.json()["status"] == "cancelled"
    def ended() -> dict | None:
        body = api_client.get(f"/api/v1/sessions/{session_id}/").json()
        return body if body["finished_at"] else None

    body = wait_for(ended, timeout=60, what="the worker to stop it")
    assert body["status"] == "cancelled" and body["finish_reason"] == "cancelled"
    assert 0 < body["token_count"] < MAX_NEW_TOKENS
    positions = list(TokenRecord.objects.filter(session_id=session_id).order_by("position")
                     .values_list("position", flat=True))
    assert positions == list(range(body["token_count"]))  # what it made before the stop, all committed
    events = stream_events(session_id)
    assert [event for _, event, _ in events].count("done") == 1
    assert events[-1][1] == "done" and events[-1][2]["status"] == "cancelled"
    streamed = sum(len(data["token_ids"]) for _, event, data in events if event == "tokens")
    assert streamed == body["token_count"]
    assert cancel(api_client, session_id).status_code == 409


def test_a_cancel_that_races_the_last_step_wins_and_the_session_ends_once(api_client, tenant, tiny_model):
    from sessions.runs import end_session

    session = make_session(tenant, tiny_model, status="running")
    assert cancel(api_client, session.pk).status_code == 200
    # The worker's last step had already produced the whole answer: it writes its end now.
    assert end_session(session, "succeeded", finish_reason="length", token_count=2, text="ab", next_step=1)
    session.refresh_from_db()
    assert (session.status, session.finish_reason, session.token_count, session.text) == ("cancelled", "cancelled", 2, "ab")
    assert session.finished_at is not None
    # A second end (a retried task, the reconciler) changes nothing and publishes nothing.
    assert end_session(session, "failed", error="late") is None
    session.refresh_from_db()
    assert (session.status, session.error) == ("cancelled", "")
    assert [(event, data["status"]) for _, event, data in stream_events(session.pk)] == [("done", "cancelled")]
