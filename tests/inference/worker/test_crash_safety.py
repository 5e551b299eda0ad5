"""Sessions survive a dead worker and a lost broker: the reconciler, on the real services.

The fast tests put rows in the states a crash leaves behind and run one reconciler pass. The
slow ones kill a real worker process group mid-generation (SIGKILL, then a restart), flush the
broker's Redis database with a session queued behind the running ones, and deliver one session
twice; each session must end exactly once, with every token (positions 0..n-1, no gap, no
duplicate), the target's greedy tokens, and one ``done`` event in its stream.
"""
from __future__ import annotations

import json
import os
import signal
import uuid
from datetime import timedelta

import psycopg
import pytest
import torch
from django.db import connection
from django.utils import timezone

from inference.tasks import reconcile_sessions as reconcile_task
from sessions.runs.reconciler import RECONCILER_LOCK, reconcile_sessions
from metadata.models import Session, TokenRecord
from metadata.partitions.locks import session_settings
from sessions.streams import token_stream
from specops.celery import app, visibility_timeout_s
from tests.helpers import wait_for
from tests.test_end_to_end import finished
from tests.test_end_to_end import target_greedy as plain_target_greedy
from tests.worker_process import start_worker, stop_worker

LEASE_S = 5  # the workers' and the reconciler's lease here: a dead worker is noticed in seconds
IDLE_QUEUE = "crash-safety-idle"  # no worker consumes it: the fast tests count its messages
# One torch thread: on a small shared machine, more threads only fight over the cores.
WORKER_ENV = {"SPECOPS_SESSION_LEASE_S": str(LEASE_S), "SPECOPS_TOKEN_FLUSH_MS": "100", "OMP_NUM_THREADS": "1"}
LONG = 300  # new tokens of the generation that is killed: long enough to kill it midway
FLUSH_TOKENS = 900  # new tokens of each flushed-broker session: 160 ended in 0.4 s, inside the test's window


@pytest.fixture
def fast_leases(settings):
    settings.SPECOPS_SESSION_LEASE_S = LEASE_S
    settings.SPECOPS_RECONCILE_QUEUED_S = 2
    settings.SPECOPS_MAX_ATTEMPTS = 3
    return settings


def broker():
    return app.connection_for_write().default_channel.client


def idle_queue_length() -> int:
    return broker().llen(IDLE_QUEUE)


def stream_events(session_id) -> list[tuple[str, dict]]:
    entries = token_stream.client().xrange(token_stream.stream_key(session_id))
    return [(fields[b"event"].decode(), json.loads(fields[b"data"])) for _id, fields in entries]


def target_greedy(model_dir, prompt: str, max_new_tokens: int) -> list[int]:
    """The target's greedy tokens (test_end_to_end's reference), on one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return plain_target_greedy(model_dir, prompt, max_new_tokens)
    finally:
        torch.set_num_threads(threads)


def make_session(tiny_model, tenant, **fields) -> Session:
    defaults = {"tenant": tenant, "target": tiny_model, "drafter": "ngram", "queue": IDLE_QUEUE,
                "prompt": "x = 1\n", "prompt_tokens": 3, "params": {"max_new_tokens": 8}}
    return Session.objects.create(**{**defaults, **fields})


# ---- one reconciler pass over crafted rows (no worker) ------------------------------------------


@pytest.fixture
def empty_idle_queue():
    broker().delete(IDLE_QUEUE)
    yield
    broker().delete(IDLE_QUEUE)


def test_a_running_session_whose_lease_lapsed_goes_back_to_its_queue(tiny_model, tenant, fast_leases,
                                                                     empty_idle_queue):
    now = timezone.now()
    lost = make_session(tiny_model, tenant, status="running", attempts=1, worker="w1",
                        lease_expires_at=now - timedelta(seconds=1))
    no_lease = make_session(tiny_model, tenant, status="running", attempts=1,
                            last_activity_at=now - timedelta(seconds=LEASE_S + 1))
    alive = make_session(tiny_model, tenant, status="running", attempts=1,
                         lease_expires_at=now + timedelta(seconds=LEASE_S))
    report = reconcile_sessions()

    assert sorted(report.resumed) == sorted([str(lost.pk), str(no_lease.pk)])
    lost.refresh_from_db()
    assert lost.status == "queued" and lost.lease_expires_at is None and lost.attempts == 1
    assert lost.enqueued_at >= now and "worker lost (attempt 1 of 3, on w1)" in lost.error
    assert Session.objects.get(pk=alive.pk).status == "running"
    assert idle_queue_length() == 2  # one task each; nothing published to their streams
    assert stream_events(lost.pk) == []
    assert reconcile_sessions().resumed == []  # queued now, with a fresh enqueue time


def test_a_session_whose_worker_was_lost_max_attempts_times_fails_with_the_reason(
        tiny_model, tenant, fast_leases, empty_idle_queue, django_capture_on_commit_callbacks):
    session = make_session(tiny_model, tenant, status="running", attempts=3, worker="w3", token_count=5,
                           lease_expires_at=timezone.now() - timedelta(seconds=1))
    with django_capture_on_commit_callbacks(execute=True):  # the end's done goes out on its commit
        report = reconcile_sessions()

    assert report.failed == [str(session.pk)] and report.resumed == []
    session.refresh_from_db()
    assert session.status == "failed" and session.finished_at is not None
    assert session.error.startswith("worker lost 3 times (last on w3)")
    assert session.token_count == 5  # what it had committed stays
    assert [event for event, _ in stream_events(session.pk)] == ["done"]
    assert idle_queue_length() == 0
    with django_capture_on_commit_callbacks(execute=True):
        reconcile_sessions()
    assert [event for event, _ in stream_events(session.pk)] == ["done"]  # ends once


def test_a_queued_session_whose_task_may_be_lost_gets_another_and_gives_up_at_last(
        tiny_model, tenant, fast_leases, empty_idle_queue):
    now = timezone.now()
    stale = make_session(tiny_model, tenant, enqueued_at=now - timedelta(seconds=5))
    legacy = make_session(tiny_model, tenant, created_at=now - timedelta(seconds=5))  # no enqueued_at
    fresh = make_session(tiny_model, tenant, enqueued_at=now)
    ancient = make_session(tiny_model, tenant, created_at=now - timedelta(hours=2),
                           enqueued_at=now - timedelta(seconds=5))
    report = reconcile_sessions()

    assert sorted(report.requeued) == sorted([str(stale.pk), str(legacy.pk)])
    assert report.failed == [str(ancient.pk)]
    assert Session.objects.get(pk=stale.pk).enqueued_at >= now
    assert Session.objects.get(pk=fresh.pk).enqueued_at == fresh.enqueued_at
    gave_up = Session.objects.get(pk=ancient.pk)
    assert gave_up.status == "failed" and "no worker took it within 3600 s" in gave_up.error
    assert idle_queue_length() == 2
    assert reconcile_sessions().requeued == []  # not again before RECONCILE_QUEUED_S


def test_one_pass_at_a_time_and_the_beat_task_says_so(tiny_model, tenant, fast_leases):
    params = session_settings()  # the primary itself: a lock through PgBouncer would outlive this test
    with psycopg.connect(dbname=params["NAME"], host=params["HOST"], port=params["PORT"], user=params["USER"],
                         autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (RECONCILER_LOCK,))
        assert "another maintenance run" in reconcile_task()["skipped"]
    assert reconcile_task()["failed"] == []
    assert app.amqp.router.route({}, "inference.reconcile_sessions")["queue"].name == "maintenance"


def test_the_brokers_visibility_timeout_outlasts_the_longest_generation_task(settings):
    timeout = app.connection_for_write().default_channel.visibility_timeout
    assert timeout == visibility_timeout_s(settings.SPECOPS_GENERATION_TIMEOUT_S, settings.CELERY_TASK_TIME_LIMIT)
    assert timeout > settings.SPECOPS_GENERATION_TIMEOUT_S + 60 and timeout < 3600


def test_the_reconciler_runs_every_15_seconds_on_the_maintenance_queue(db):
    from django_celery_beat.models import PeriodicTask

    from metadata.partitions import register_periodic_tasks

    register_periodic_tasks()  # (the migration registered it; a transactional test may have flushed it)

    job = PeriodicTask.objects.using("default").select_related("interval").get(task="inference.reconcile_sessions")
    assert (job.interval.every, job.interval.period, job.queue) == (15, "seconds", "maintenance")


# ---- real workers: SIGKILL, broker flush, duplicate delivery -----------------------------------


def generation(api_client, prompt: str, max_new_tokens: int) -> str:
    created = api_client.post("/api/v1/generations/", {"prompt": prompt, "max_new_tokens": max_new_tokens,
                                                       "drafter": "draft_model"}, format="json")
    assert created.status_code == 202, created.content
    return created.json()["id"]


def committed(session_id) -> int:
    return TokenRecord.objects.filter(session_id=session_id).count()


def assert_ended_once(api_client, session_id, expected: list[int] | None) -> dict:
    """Succeeded, every token once (0..n-1), the target's greedy tokens (when given), one
    ``done`` event."""
    body = api_client.get(f"/api/v1/sessions/{session_id}/").json()
    assert body["status"] == "succeeded", body["error"]
    rows = list(TokenRecord.objects.filter(session_id=session_id).order_by("position")
                .values_list("position", "token_id"))
    assert [position for position, _ in rows] == list(range(len(rows)))
    assert body["token_count"] == len(rows) > 0
    if expected is not None:
        assert [token for _, token in rows] == expected
    # The final event goes out just after the final row commits.
    wait_for(lambda: "done" in [event for event, _ in stream_events(session_id)], timeout=5, what="the done event")
    assert [event for event, _ in stream_events(session_id)].count("done") == 1
    return body


def stream_steps(session_id) -> tuple[list[int], int]:
    """(the token ids of the stream's distinct steps in step order, how many steps came again).

    A resumed run may publish again the steps the crashed run streamed but had not committed;
    each repeat must carry the same tokens as the first (greedy), so a reader that skips a step
    it has seen loses nothing."""
    first: dict[int, list[int]] = {}
    repeats = 0
    for event, data in stream_events(session_id):
        if event != "tokens":
            continue
        if data["step"] in first:
            repeats += 1
            assert data["token_ids"] == first[data["step"]], f"step {data['step']} came again, changed"
        else:
            first[data["step"]] = data["token_ids"]
    return [token for step in sorted(first) for token in first[step]], repeats


def nonce_prompt(body: str) -> str:
    """A prompt of its own each run: the prediction cache of an earlier run cannot answer it."""
    return f"# {uuid.uuid4().hex[:8]}\n{body}"


@pytest.fixture
def clean_broker():
    app.control.purge()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_session_whose_worker_was_killed_resumes_after_a_restart_and_ends_once(
        api_client, tiny_model, fast_leases, tmp_path, clean_broker):
    prompt = nonce_prompt("def parse(text):\n    ")
    expected = target_greedy(tiny_model.directory, prompt, LONG)
    assert len(expected) > 100, "the tiny model ends too early for a mid-generation kill"
    worker = start_worker("cpu", "crash-a", tmp_path / "a.log", extra_env=WORKER_ENV)
    try:
        session_id = generation(api_client, prompt, LONG)
        wait_for(lambda: committed(session_id) >= 10, timeout=120, interval=0.02, what="committed tokens")
    finally:
        os.killpg(worker.pid, signal.SIGKILL)  # the whole worker: no warm shutdown, no ack, no final write
        worker.wait()
    at_kill = committed(session_id)
    assert Session.objects.get(pk=session_id).status == "running"
    assert at_kill < len(expected), "the generation ended before the kill"

    worker = start_worker("cpu", "crash-b", tmp_path / "b.log", extra_env=WORKER_ENV)
    try:
        wait_for(lambda: reconcile_sessions().resumed == [session_id], timeout=LEASE_S + 30, interval=0.5,
                 what="the reconciler to notice the lost worker")
        wait_for(lambda: finished(api_client, session_id), timeout=120, what="the resumed generation")
    finally:
        stop_worker(worker)

    body = assert_ended_once(api_client, session_id, expected)
    assert body["attempts"] == 2
    streamed, repeats = stream_steps(session_id)
    assert streamed == expected
    print(f"killed at {at_kill} committed tokens of {len(expected)}; {repeats} steps streamed again")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_flushed_broker_loses_no_session(api_client, tiny_model, fast_leases, tmp_path, clean_broker):
    """Four sessions fill the worker's four task threads; the fifth waits in the broker and is
    lost with it; the reconciler sends it again and every session ends once."""
    prompts = [nonce_prompt(body) for body in ("import os\n", "class Node:\n", "for i in range(", "while x:\n",
                                               "def main():\n")]
    worker = start_worker("cpu", "crash-flush", tmp_path / "flush.log", extra_env=WORKER_ENV)
    try:
        # FLUSH_TOKENS each: the four running sessions hold their threads for seconds, so none ends
        # (and frees a thread for the fifth's message) between the checks below and the flush
        ids = [generation(api_client, prompt, FLUSH_TOKENS) for prompt in prompts]
        wait_for(lambda: Session.objects.filter(pk__in=ids, status="running").count() == 4, timeout=60,
                 interval=0.05, what="four sessions running")
        wait_for(lambda: committed(ids[0]) >= 1, timeout=60, interval=0.05, what="tokens committed")
        queued = Session.objects.get(pk__in=ids, status="queued")
        broker().flushdb()  # the queued task, the running tasks' unacked entries, the streams so far
        assert Session.objects.get(pk=queued.pk).status == "queued", "the fifth was taken before the flush"
        wait_for(lambda: reconcile_sessions().requeued == [str(queued.pk)], timeout=30, interval=0.5,
                 what="the reconciler to send the lost task again")
        bodies = [wait_for(lambda sid=sid: finished(api_client, sid), timeout=180, what="a generation")
                  for sid in ids]
    finally:
        stop_worker(worker)

    for prompt, session_id, body in zip(prompts, ids, bodies):
        # the target's greedy tokens for the lost one and one that ran through the flush (time)
        check_tokens = session_id in (ids[0], str(queued.pk))
        expected = target_greedy(tiny_model.directory, prompt, FLUSH_TOKENS) if check_tokens else None
        assert_ended_once(api_client, session_id, expected)
        assert body["attempts"] == 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_two_deliveries_of_one_session_run_it_once(api_client, tiny_model, fast_leases, tmp_path, clean_broker):
    from inference.tasks import generate

    prompt = nonce_prompt("def twice(a, b):\n    ")
    session_id = generation(api_client, prompt, 48)  # no worker yet: both messages wait together
    generate.apply_async(args=[session_id], queue="cpu")
    log = tmp_path / "twice.log"
    worker = start_worker("cpu", "crash-twice", log, extra_env=WORKER_ENV)
    try:
        wait_for(lambda: finished(api_client, session_id), timeout=120, what="the generation")
        wait_for(lambda: log.read_text().count("sessions.generate[") >= 4, timeout=30,
                 what="both deliveries received and done")  # "received" + "succeeded" each
    finally:
        stop_worker(worker)
    body = assert_ended_once(api_client, session_id, target_greedy(tiny_model.directory, prompt, 48))
    assert body["attempts"] == 1
    assert log.read_text().count("sessions.generate[") >= 4
