"""A session cancelled while it ran is ended even when its worker dies before writing the end.

Cancelling a running session leaves its end to the batching loop (it stops at its next step);
a loop that died never writes it, and the session stayed ``cancelled`` with no ``finished_at`` and
no ``done`` in its stream, its followers waiting to their idle limit. The reconciler ends it once
its lease has lapsed: cancelled, finished, its stream told once; a live worker's cancel is left
to the worker.
"""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from sessions.runs.reconciler import reconcile_sessions
from metadata.models import Session
from sessions.streams import token_stream
from sessions.runs import cancel_sessions

LEASE_S = 5


@pytest.fixture
def fast_leases(settings):
    settings.SPECOPS_SESSION_LEASE_S = LEASE_S


def running(tiny_model, tenant, lease_left_s: float) -> Session:
    return Session.objects.create(
        tenant=tenant, target=tiny_model, drafter="ngram", queue="cancel-lost-idle", prompt="x = 1\n",
        prompt_tokens=3, params={"max_new_tokens": 8}, status="running", attempts=1, worker="w1", token_count=2,
        lease_expires_at=timezone.now() + timedelta(seconds=lease_left_s))


def events(session_id) -> list[dict]:
    entries = token_stream.client().xrange(token_stream.stream_key(session_id))
    return [json.loads(fields[b"data"]) for _id, fields in entries if fields[b"event"] == b"done"]


@pytest.mark.django_db
def test_a_cancelled_session_whose_worker_died_is_ended_by_the_reconciler(
        tiny_model, tenant, fast_leases, django_capture_on_commit_callbacks):
    session = running(tiny_model, tenant, LEASE_S)
    assert cancel_sessions(Session.objects.filter(pk=session.pk)) == (0, 1)
    assert Session.objects.get(pk=session.pk).finished_at is None  # left to its worker, which dies now
    Session.objects.filter(pk=session.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))

    with django_capture_on_commit_callbacks(execute=True):  # the end's done goes out on its commit
        report = reconcile_sessions()
    assert report.cancelled == [str(session.pk)] and report.failed == [] and report.resumed == []
    session.refresh_from_db()
    assert session.status == "cancelled" and session.finish_reason == "cancelled"
    assert session.finished_at is not None and session.error == "" and session.token_count == 2
    assert [event["status"] for event in events(session.pk)] == ["cancelled"]
    with django_capture_on_commit_callbacks(execute=True):
        assert reconcile_sessions().cancelled == []
    assert len(events(session.pk)) == 1  # ended once


@pytest.mark.django_db
def test_a_cancelled_session_whose_worker_lives_is_left_to_it(tiny_model, tenant, fast_leases):
    session = running(tiny_model, tenant, LEASE_S)
    cancel_sessions(Session.objects.filter(pk=session.pk))
    assert reconcile_sessions().cancelled == []
    assert Session.objects.get(pk=session.pk).finished_at is None
    assert events(session.pk) == []
