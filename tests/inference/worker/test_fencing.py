"""Fenced leases (issue 27): a run whose session another run has claimed since writes nothing.

The fast tests claim a session twice on the real PostgreSQL and Redis and let the first (stale)
run try every write it makes: token and candidate rows, progress, a lease renewal, its end, and
a stream publish; then a batching loop is handed a second row for a session it runs; and a
worker's clock that runs an hour ahead changes no lease. The slow one pauses a real worker with
SIGSTOP past its lease while it generates, lets the reconciler re-queue its sessions and resumes
it: every session ends once, with exactly the target's greedy tokens.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.db import Error, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from inference.engine.batch.engine import BatchRequest, RowEvent
from inference.engine.config import GenerationConfig
from inference.engine.outputs import Branch, StepOutput
from inference.engine.stats import GenerationStats
from metadata.models import ModelVersion
from sessions.runs.adoption import start_stream
from inference.worker.batching_loop import DeviceBatchLoop
from sessions.runs import (
    SUPERSEDED,
    end_session,
    LeaseKeeper,
    claim_session,
    database_now,
    lock_owned,
    renew_leases,
)
from sessions.runs.reconciler import reconcile_sessions
from inference.worker.recorder import BatchRecorder, SessionRecorder
from inference.worker.session_job import SessionJob
from metadata.models import Candidate, Session, TokenRecord
from metadata.replicas import lsn
from sessions.streams import token_stream
from tests.helpers import claim, wait_for

LEASE_S = 3


@pytest.fixture(autouse=True)
def short_leases(settings):
    settings.SPECOPS_SESSION_LEASE_S = LEASE_S
    settings.SPECOPS_TOKEN_FLUSH_MS = 1
    settings.SPECOPS_PROGRESS_MS = 1
    with lsn.primary_only():
        yield


@pytest.fixture
def target(db) -> ModelVersion:
    return ModelVersion.objects.create(name="fenced", version="1", role="target", path="/nonexistent",
                                       context_length=512, status="active")


def decode(ids) -> str:
    return "".join(chr(97 + token % 26) for token in ids)


def new_session(tenant, target, **fields) -> Session:
    return Session.objects.create(tenant=tenant, target=target, drafter="ngram", queue="fencing-idle", prompt="x",
                                  prompt_tokens=1, params={"max_new_tokens": 8}, **fields)


def lapse(session: Session) -> None:
    """The lease ran out (the worker was paused), as the database's clock sees it."""
    Session.objects.filter(pk=session.pk).update(lease_expires_at=database_now() - timedelta(seconds=1))


def step_event(session_id, tokens: list[int], finish: str | None = None) -> RowEvent:
    return RowEvent(session_id, StepOutput(tokens, drafted=2, accepted=1, finish_reason=finish,
                                           branches=[Branch(tuple(tokens), -0.5, 1)]), GenerationStats())


def stream_events(session_id) -> list[tuple[str, str, dict]]:
    entries = token_stream.client().xrange(token_stream.stream_key(session_id))
    return [(i.decode(), f[b"event"].decode(), json.loads(f[b"data"])) for i, f in entries]


@pytest.fixture
def clean_stream():
    made = []

    def track(session_id):
        made.append(session_id)
        return session_id

    yield track
    for session_id in made:
        token_stream.client().delete(token_stream.stream_key(session_id), token_stream.fence_key(session_id))


# ---- the claim by id (a task's message) ---------------------------------------------------------


def test_a_claim_by_id_reads_the_session_and_its_models_back_in_one_statement(tenant, target):
    draft = ModelVersion.objects.create(name="fenced-draft", version="1", role="draft", path="/nonexistent",
                                        context_length=512, status="active")
    plain = new_session(tenant, target)
    drafted = new_session(tenant, target, draft=draft)
    legacy = new_session(tenant, target, id=uuid.uuid4(), created_at=timezone.now())  # no time in its id

    with CaptureQueriesContext(connections["default"]) as queries:
        claimed = claim_session(str(plain.pk))
    assert len(queries) == 1
    assert (claimed.pk, claimed.status, claimed.attempts, claimed.prompt) == (plain.pk, "running", 1, "x")
    assert claimed.params == {"max_new_tokens": 8}  # as the ORM reads it: a dict, not its JSON text
    assert claimed.created_at == plain.created_at and claimed.tenant_id == tenant.pk
    assert claimed.target.pk == target.pk and claimed.target.path == "/nonexistent" and claimed.draft is None
    assert claimed.started_at is not None and claimed.lease_expires_at > claimed.started_at
    with CaptureQueriesContext(connections["default"]) as queries:  # the models came with it
        assert (claimed.target.name, claimed.tenant_id) == ("fenced", tenant.pk)
    assert len(queries) == 0

    assert claim_session(drafted.pk).draft.name == "fenced-draft"
    assert claim_session(legacy.pk).attempts == 1

    assert claim_session(plain.pk) is None  # its lease is held
    lapse(plain)
    assert claim_session(plain.pk).attempts == 2  # a lapsed lease: the next run's fence
    Session.objects.filter(pk=plain.pk).update(status="succeeded")
    lapse(plain)
    assert claim_session(plain.pk) is None  # ended: never claimed again
    assert claim_session(uuid.uuid4()) is None  # no such session


# ---- the database refuses a stale run's writes ----------------------------------------------------


def test_a_stale_runs_rows_progress_renewal_and_end_are_refused_after_a_second_claim(tenant, target, clean_stream):
    session = new_session(tenant, target)
    clean_stream(session.pk)
    assert claim(session) == 1
    batch = BatchRecorder()
    first = SessionRecorder(session, decode)
    first.record(step_event(session.pk, [1, 2]), batch.writer)
    assert batch.write(batch.take([first])) == set()  # its own rows, while it owns the session
    first.record(step_event(session.pk, [3, 4]), batch.writer)
    stale_flush = batch.take([first])

    lapse(session)  # paused past its lease; another delivery claims it
    second = Session.objects.get(pk=session.pk)
    assert claim(second) == 2 and session.attempts == 1

    assert batch.write(stale_flush) == {(session.pk, 1)}
    assert list(TokenRecord.objects.filter(session_id=session.pk).order_by("position")
                .values_list("position", flat=True)) == [0, 1]
    assert Candidate.objects.filter(session_id=session.pk).count() == 1
    row = Session.objects.get(pk=session.pk)
    assert row.token_count == 2 and row.text == "bc"  # the progress of the first flush only
    lease = row.lease_expires_at
    assert renew_leases({session.pk: 1}) == {session.pk}
    assert Session.objects.get(pk=session.pk).lease_expires_at == lease
    assert not end_session(session, "succeeded", finish_reason="length", token_count=4, text="bcde",
                              next_step=2)
    row = Session.objects.get(pk=session.pk)
    assert (row.status, row.attempts, row.finished_at, row.token_count) == ("running", 2, None, 2)
    assert stream_events(session.pk) == []  # no done from the stale run

    # the run that holds the fence now writes all of it
    assert renew_leases({session.pk: 2}) == set()
    assert Session.objects.get(pk=session.pk).lease_expires_at > lease
    assert end_session(second, "succeeded", finish_reason="length", token_count=2, text="bc", next_step=1)
    assert Session.objects.get(pk=session.pk).status == "succeeded"


def test_a_session_handed_back_to_its_queue_takes_no_write_from_its_old_run(tenant, target, clean_stream):
    session = new_session(tenant, target)
    clean_stream(session.pk)
    claim(session)
    batch = BatchRecorder()
    recorder = SessionRecorder(session, decode)
    recorder.record(step_event(session.pk, [1, 2]), batch.writer)
    lapse(session)
    assert reconcile_sessions().resumed == [str(session.pk)]  # queued again, attempts unchanged

    assert batch.write(batch.take([recorder])) == {(session.pk, 1)}
    assert TokenRecord.objects.filter(session_id=session.pk).count() == 0
    assert renew_leases({session.pk: 1}) == {session.pk}
    assert not end_session(session, "failed", error="late")
    assert Session.objects.get(pk=session.pk).status == "queued"
    assert not token_stream.publish(session.pk, "tokens", {"step": 0}, step=0, fence=1)  # its stream too
    assert stream_events(session.pk) == []


def test_a_stale_publish_is_refused_by_the_stream_script(tenant, target, clean_stream):
    session_id = clean_stream(new_session(tenant, target).pk)
    tokens = lambda step, fence: token_stream.StreamEvent(session_id, "tokens", {"step": step}, step=step,
                                                          fence=fence)
    assert token_stream.begin_run(session_id, 1, -1) == token_stream.RunStart(stale=False)
    assert token_stream.publish_fenced([tokens(0, 1), tokens(1, 1)]) == [token_stream.ADDED] * 2
    # run 2 resumes after step 0 (its only committed one): it adopts step 1, and run 1 can no longer add
    assert [entry.id for entry in token_stream.begin_run(session_id, 2, 0).adopted] == ["2-0"]
    assert token_stream.publish_fenced([tokens(1, 1), tokens(2, 1)]) == [token_stream.STALE] * 2
    assert token_stream.begin_run(session_id, 1, 0).stale  # an older claim reads nothing, changes nothing
    assert token_stream.publish_fenced([tokens(1, 2), tokens(2, 2)]) == [token_stream.DUPLICATE, token_stream.ADDED]
    assert token_stream.publish(session_id, "done", {"status": "succeeded"}, step=3, fence=2)
    assert not token_stream.publish(session_id, "tokens", {"step": 4}, step=4, fence=2)  # sealed by done
    assert [(entry_id, event) for entry_id, event, _ in stream_events(session_id)] == [
        ("1-0", "tokens"), ("2-0", "tokens"), ("3-0", "tokens"), ("4-0", "done")]


# ---- the loop: one row per session ---------------------------------------------------------------


class KeyedEngine:
    """Stands in for BatchedSpeculativeEngine, which knows its rows by session id: two tokens per
    row and step until ``steps``; a cancelled row leaves at the next step with its last event; a
    second row for an id it still holds is refused, as the real engine cannot tell them apart."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.rows: dict = {}  # request id -> [tokens made, cancelled]
        self.forward_log: list = []
        self.last_decision = None
        self.last_step_timing = None
        self.active = 0

    def submit(self, request: BatchRequest) -> None:
        assert request.request_id not in self.rows, "two rows of one session in the engine"
        self.rows[request.request_id] = [len(request.resume_ids), False]

    def cancel(self, request_id) -> None:
        if request_id in self.rows:
            self.rows[request_id][1] = True

    def has_work(self) -> bool:
        return bool(self.rows)

    def step(self, early=None) -> list[RowEvent]:  # no prefill lane: nothing goes early
        time.sleep(0.01)
        events = []
        for request_id, state in list(self.rows.items()):
            if state[1]:
                events.append(step_event(request_id, [], "cancelled"))
                del self.rows[request_id]
                continue
            made = state[0]
            state[0] += 2
            finish = "length" if state[0] >= self.steps * 2 else None
            events.append(step_event(request_id, [made + 1, made + 2], finish))
            if finish:
                del self.rows[request_id]
        return events


def job_for(session: Session, resumed: list[int] | None = None) -> SessionJob:
    resumed = resumed or []
    request = BatchRequest(request_id=session.pk, prompt_ids=[1], config=GenerationConfig(max_new_tokens=40),
                           drafter="ngram", resume_ids=tuple(resumed))
    recorder = SessionRecorder(session, decode, token_ids=list(resumed), step=len(resumed) // 2)
    return SessionJob(session=session, request=request, target=SimpleNamespace(tokenizer=SimpleNamespace(decode=decode)),
                      draft=None, model_name="fenced@1", recorder=recorder)


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_the_loop_refuses_a_second_row_for_a_session_and_the_older_run_leaves(tenant, target, clean_stream):
    session = new_session(tenant, target)
    clean_stream(session.pk)
    claim(session)
    loop = DeviceBatchLoop(max_rows=8, prefill_chunk=0, policy_enabled=False)
    engine = loop.engines[(target.pk, None)] = KeyedEngine(steps=20)
    old = job_for(session)
    loop.inbox.put(old)
    try:
        deadline = time.monotonic() + 60
        while len(old.recorder.token_ids) < 6:
            assert time.monotonic() < deadline and not old.done.is_set(), "the old run never made 6 tokens"
            loop._run_once()
        loop.writes.join()
        lapse(session)
        again = Session.objects.get(pk=session.pk)
        assert claim(again) == 2
        committed = list(TokenRecord.objects.filter(session_id=session.pk).order_by("position")
                         .values_list("token_id", flat=True))
        resumed, _next_step = start_stream(again, committed, len(committed) // 2, decode)  # what prepare does
        new = job_for(again, resumed)
        loop.inbox.put(new)
        deadline = time.monotonic() + 30
        while (loop.jobs or engine.rows or loop._deferred or not loop.inbox.empty()) and time.monotonic() < deadline:
            loop._run_once()
        assert old.done.wait(5) and old.status == SUPERSEDED
        assert new.done.wait(30) and new.status == "succeeded"
    finally:
        loop.writes.close()
        connections.close_all()
    rows = list(TokenRecord.objects.filter(session_id=session.pk).order_by("position")
                .values_list("position", "token_id"))
    assert rows == [(position, position + 1) for position in range(40)]
    ended = Session.objects.get(pk=session.pk)
    assert (ended.status, ended.token_count, ended.attempts) == ("succeeded", 40, 2)
    events = stream_events(session.pk)
    assert [event for _, event, _ in events] == ["tokens"] * 20 + ["done"]
    assert [token for _, event, data in events if event == "tokens" for token in data["token_ids"]] == list(range(1, 41))


# ---- the database's clock -------------------------------------------------------------------------


def test_leases_are_measured_by_the_database_clock_not_the_workers(tenant, target, monkeypatch, settings):
    settings.SPECOPS_RECONCILE_QUEUED_S = 3600
    session = new_session(tenant, target)
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(hours=1))  # this host's clock runs ahead

    before = database_now()
    assert claim(session) == 1
    lease = Session.objects.get(pk=session.pk).lease_expires_at
    assert before < lease <= database_now() + timedelta(seconds=LEASE_S)
    assert renew_leases({session.pk: 1}) == set()
    assert Session.objects.get(pk=session.pk).lease_expires_at <= database_now() + timedelta(seconds=LEASE_S)
    # a reconciler on this host does not take the live session for a lost worker's
    assert reconcile_sessions().resumed == []
    assert Session.objects.get(pk=session.pk).status == "running"


@pytest.mark.django_db(transaction=True)  # the keeper's thread has a connection of its own
def test_the_lease_is_renewed_while_the_models_load_and_a_takeover_is_noticed(tenant, target, settings):
    settings.SPECOPS_SESSION_LEASE_S = 0.6  # renewed every 0.2 s
    session = new_session(tenant, target)
    claim(session)
    claimed = Session.objects.get(pk=session.pk).lease_expires_at
    with LeaseKeeper(session) as keeper:
        time.sleep(1.0)  # a model load longer than the lease
        assert Session.objects.get(pk=session.pk).lease_expires_at > max(claimed, database_now())
        assert not keeper.stale
        Session.objects.filter(pk=session.pk).update(attempts=2)  # another run's claim (the keeper renews on)
        time.sleep(0.5)
    assert keeper.stale


@pytest.mark.django_db(transaction=True)  # the stalled write is a real transaction; the claim, another thread's
def test_a_run_stalled_inside_its_write_holds_the_session_no_longer_than_a_lease(tenant, target, settings):
    """A worker paused or cut off between a write's lock and its commit (issue 27's pause and
    partition across hosts) held the session row until it came back: no claim, no reconciler pass.
    The database now ends such a transaction a lease after the run went quiet."""
    settings.SPECOPS_SESSION_LEASE_S = 1
    session = new_session(tenant, target)
    assert claim(session) == 1
    taken_over = {}

    def another_worker() -> None:
        try:
            time.sleep(0.3)
            started = time.monotonic()
            lapse(session)  # waits on the stalled run's lock, as the reconciler's re-queue would
            taken_over["fence"] = claim(Session.objects.get(pk=session.pk))
            taken_over["waited"] = time.monotonic() - started
        finally:
            connections.close_all()

    thread = threading.Thread(target=another_worker)
    with pytest.raises(Error):  # terminating connection due to idle-in-transaction timeout
        with transaction.atomic():
            assert lock_owned({(session.pk, 1)}) == {(session.pk, 1)}
            thread.start()
            time.sleep(4)  # the run stalls with the lock held (a SIGSTOP, a partition)
            Session.objects.filter(pk=session.pk).update(token_count=99)  # it wakes: its transaction is gone
    connections["default"].close()
    thread.join(timeout=10)
    assert taken_over["fence"] == 2 and taken_over["waited"] < 3
    row = Session.objects.get(pk=session.pk)
    assert (row.attempts, row.token_count) == (2, 0)


# ---- a real worker paused past its lease -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_paused_past_its_lease_and_resumed_ends_each_session_once(api_client, tiny_model, tmp_path,
                                                                           settings):
    from inference.engine.lm.loading import load_causal_lm
    from metadata.history import pg_text
    from specops.celery import app
    from tests.inference.worker.test_crash_safety import (
        assert_ended_once,
        committed,
        generation,
        nonce_prompt,
        stream_steps,
        target_greedy,
    )
    from tests.test_end_to_end import finished
    from tests.worker_process import start_worker, stop_worker

    settings.SPECOPS_MAX_ATTEMPTS = 3
    app.control.purge()
    new_tokens = 300  # long enough that the pause comes midway: 90 tokens took 0.2-0.3 s, often over before it
    prompts = [nonce_prompt(body) for body in ("def parse(text):\n    ", "class Node:\n    ")]
    expected = [target_greedy(tiny_model.directory, prompt, new_tokens) for prompt in prompts]
    worker = start_worker("cpu", "fenced", tmp_path / "fenced.log", extra_env={
        "SPECOPS_SESSION_LEASE_S": str(LEASE_S), "SPECOPS_TOKEN_FLUSH_MS": "50", "OMP_NUM_THREADS": "1"})
    paused = False
    try:
        ids = [generation(api_client, prompt, new_tokens) for prompt in prompts]
        wait_for(lambda: all(committed(sid) >= 4 for sid in ids), timeout=60, interval=0.01,
                 what="tokens committed")
        os.killpg(worker.pid, signal.SIGSTOP)
        paused = True
        assert Session.objects.filter(pk__in=ids, status="running").count() == len(ids), "ended before the pause"
        wait_for(lambda: set(reconcile_sessions().resumed) == set(ids) or
                 Session.objects.filter(pk__in=ids, status="queued").count() == len(ids),
                 timeout=LEASE_S + 20, interval=0.5, what="the reconciler to re-queue the paused sessions")
        os.killpg(worker.pid, signal.SIGCONT)
        paused = False
        bodies = [wait_for(lambda sid=sid: finished(api_client, sid), timeout=90, what="a generation") for sid in ids]
    finally:
        if paused:
            os.killpg(worker.pid, signal.SIGCONT)
        stop_worker(worker)

    tokenizer = load_causal_lm(tiny_model.directory).tokenizer
    for session_id, tokens, body in zip(ids, expected, bodies):
        ended = assert_ended_once(api_client, session_id, tokens)  # positions 0..n-1, greedy, one done
        assert ended["token_count"] == len(tokens) <= new_tokens
        assert ended["attempts"] == 2
        assert ended["text"] == pg_text(tokenizer.decode(tokens))
        streamed, _repeats = stream_steps(session_id)
        assert streamed == tokens
    assert "stale" in (tmp_path / "fenced.log").read_text()  # the paused runs woke up and left
