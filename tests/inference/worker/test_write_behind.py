"""The batching loop's writer thread (inference/worker/write_behind.py).

The queue's own rules (order, a write that raises, the bound) are checked with plain callables.
The loop's are checked on the real PostgreSQL and Redis: a real `DeviceBatchLoop`, stepped by a
thread of the test, whose engine is scripted (it stands in for the models: every session gets the
same steps, and all of them end on the same step), and its writer thread. A table lock held by
the test holds the writer's INSERTs back, so what must wait for the rows is seen to wait.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from types import SimpleNamespace

import psycopg
import pytest
from django.db import connection, connections
from prometheus_client import REGISTRY

from inference.engine.batch.engine import BatchRequest, RowEvent
from inference.engine.config import GenerationConfig
from inference.engine.outputs import Branch, StepOutput
from inference.engine.stats import GenerationStats
from metadata.models import ModelVersion
from sessions.runs import database_retry
from inference.worker.batching_loop import DeviceBatchLoop
from inference.worker.recorder import SessionRecorder
from inference.worker.session_job import SessionJob
from inference.worker.write_behind import WriteBehind
from metadata.models import Candidate, Session, TokenRecord
from metadata.replicas import lsn
from sessions.streams import token_stream
from tests.helpers import wait_for

# ---- the queue alone ----------------------------------------------------------------------------


def test_items_run_in_the_order_put_and_one_that_raises_stops_nothing():
    writes = WriteBehind(max_items=8)
    ran = []

    def fail():
        raise RuntimeError("PostgreSQL went away")

    failures_before = REGISTRY.get_sample_value("specops_batch_writer_failures_total") or 0.0
    try:
        for number in range(20):
            writes.put(ran.append, number)
            if number == 5:
                writes.put(fail)
        writes.join()
        assert ran == list(range(20))
        assert writes.failures == 1
        assert REGISTRY.get_sample_value("specops_batch_writer_failures_total") - failures_before == 1
    finally:
        writes.close()


@contextlib.contextmanager
def writer_held(writes: WriteBehind):
    """The writer busy with an item until the event yielded is set (or the block ends)."""
    release, started = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(10)

    try:
        writes.put(slow)
        assert started.wait(5)  # the writer holds it: nothing more runs
        yield release
    finally:
        release.set()
        writes.close()


def test_a_full_queue_blocks_the_loop_until_the_writer_catches_up():
    writes, ran = WriteBehind(max_items=3), []
    with writer_held(writes) as release:
        for number in range(3):
            writes.put(ran.append, number)  # up to max_items wait without blocking
        putter = threading.Thread(target=writes.put, args=(ran.append, 3))
        putter.start()
        putter.join(0.5)
        assert putter.is_alive(), "a put past max_items must wait"
        assert writes.waiting == 3 and ran == []
        release.set()
        putter.join(5)
        assert not putter.is_alive()
        writes.join()
        assert ran == [0, 1, 2, 3]


def test_a_blocked_put_calls_back_about_once_a_second_and_a_failing_callback_loses_nothing():
    calls, ran = [], []

    def renew():
        calls.append(time.monotonic())
        raise RuntimeError("PostgreSQL went away")

    writes = WriteBehind(max_items=1, while_blocked=renew)
    with writer_held(writes) as release:
        writes.put(ran.append, 0)  # fills the queue
        putter = threading.Thread(target=writes.put, args=(ran.append, 1))
        putter.start()
        putter.join(2.5)
        assert putter.is_alive() and 2 <= len(calls) <= 3  # LIVENESS_CHECK_S apart
        release.set()
        putter.join(5)
        writes.join()
        assert ran == [0, 1]  # the callback raised; the item still went in


def test_close_runs_what_was_put_then_a_put_starts_a_writer_again():
    writes = WriteBehind()
    ran = []
    writes.put(time.sleep, 0.1)
    writes.put(ran.append, "before")
    writes.close()
    assert ran == ["before"]
    writes.put(ran.append, "after")
    writes.join()
    writes.close()
    assert ran == ["before", "after"]


# ---- the loop's writes, on the real services ---------------------------------------------------

# The loop's threads see the test's rows, and read from the replica as in a worker.
on_the_services = pytest.mark.django_db(transaction=True, databases="__all__")
STEP_TOKENS = 2


def decode(ids) -> str:
    return "".join(chr(97 + token % 26) for token in ids)


class ScriptedEngine:
    """Stands in for BatchedSpeculativeEngine: once ``sessions`` requests are in, each step gives
    every one of them two tokens and a candidate, and the last step ends them all; with ``fail``,
    the step raises it instead."""

    def __init__(self, sessions: int, steps: int, fail: Exception | None = None) -> None:
        self.sessions, self.steps, self.fail = sessions, steps, fail
        self.requests: list[BatchRequest] = []
        self.taken = 0
        self.forward_log: list = []
        self.last_decision = None
        self.last_step_timing = None
        self.active = 0

    def submit(self, request: BatchRequest) -> None:
        self.requests.append(request)
        self.active += 1

    def cancel(self, request_id) -> None:
        pass

    def has_work(self) -> bool:
        return len(self.requests) == self.sessions and self.taken < self.steps

    def step(self, early=None) -> list[RowEvent]:  # no prefill lane: nothing goes early
        if self.fail is not None:
            raise self.fail
        step, self.taken = self.taken, self.taken + 1
        tokens = [STEP_TOKENS * step + offset + 1 for offset in range(STEP_TOKENS)]
        reason = "length" if self.taken == self.steps else None
        return [RowEvent(request.request_id, StepOutput(tokens, drafted=2, accepted=1, finish_reason=reason,
                                                        branches=[Branch(tuple(tokens), -0.5, 1)]),
                         GenerationStats(), drafter="ngram")
                for request in self.requests]


@pytest.fixture(autouse=True)
def checks_read_the_primary():
    """The test's own reads see what the writer thread has just committed."""
    with lsn.primary_only():
        yield


@pytest.fixture
def target(db) -> ModelVersion:
    return ModelVersion.objects.create(name="written", version="1", role="target", path="/nonexistent",
                                       context_length=512, status="active")


@pytest.fixture
def new_loop(target):
    """A loop with a scripted engine for the target's sessions; its writer stops after the test."""
    made: list[DeviceBatchLoop] = []

    def make(engine: ScriptedEngine, write_queue: int = 256) -> DeviceBatchLoop:
        loop = DeviceBatchLoop(max_rows=16, prefill_chunk=0, policy_enabled=False, write_queue=write_queue)
        loop.engines[(target.pk, None)] = engine
        made.append(loop)
        return loop

    yield make
    for loop in made:
        loop.writes.close()


def hand_over(loop: DeviceBatchLoop, tenant, target, count: int, max_new_tokens: int) -> list[SessionJob]:
    """``count`` running sessions, in the loop's inbox as a task thread's submit leaves them."""
    jobs = []
    for _ in range(count):
        session = Session.objects.create(tenant=tenant, target=target, drafter="ngram", queue="cpu", prompt="x",
                                         prompt_tokens=1, status="running",
                                         params={"max_new_tokens": max_new_tokens})
        request = BatchRequest(request_id=session.pk, prompt_ids=[1],
                               config=GenerationConfig(max_new_tokens=max_new_tokens), drafter="ngram")
        job = SessionJob(session=session, request=request, target=SimpleNamespace(tokenizer=SimpleNamespace(
            decode=decode)), draft=None, model_name="written@1", recorder=SessionRecorder(session, decode))
        loop.inbox.put(job)
        jobs.append(job)
    return jobs


def stepping(loop: DeviceBatchLoop) -> threading.Thread:
    """The loop's thread for the test: it turns until every session it was handed has left it."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            while True:
                loop._run_once()
                if not loop.jobs and loop.inbox.empty():
                    return
        except BaseException as error:  # noqa: BLE001 (the test reports it)
            failures.append(error)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name="test-batching-loop", daemon=True)
    thread.failures = failures
    thread.start()
    return thread


def stream_events(session_id) -> list[tuple[str, str, dict]]:
    entries = token_stream.client().xrange(token_stream.stream_key(session_id))
    return [(i.decode(), f[b"event"].decode(), json.loads(f[b"data"])) for i, f in entries]


@contextlib.contextmanager
def token_table_locked():
    """Another session holds a SHARE lock on the token table (reads go on, INSERTs wait)."""
    params = connection.settings_dict
    with psycopg.connect(dbname=params["NAME"], host=params["HOST"], port=params["PORT"],
                         user=params["USER"]) as other:
        other.execute("LOCK TABLE metadata_token IN SHARE MODE")
        yield
    # leaving the block commits: the lock goes


def backend_pid(into: list[int]) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        into.append(cursor.fetchone()[0])


def a_write_waits_on_the_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
                       "WHERE NOT l.granted AND d.datname = current_database()")
        return cursor.fetchone()[0] > 0


def assert_ended_once(job: SessionJob, status: str, steps: int) -> list[tuple[str, str, dict]]:
    session = Session.objects.get(pk=job.session.pk)
    assert session.status == status and session.finished_at is not None, session.error
    events = stream_events(job.session.pk)
    assert [event for _, event, _ in events] == ["tokens"] * steps + ["done"]
    assert [entry_id for entry_id, _, _ in events] == [f"{n + 1}-0" for n in range(steps + 1)]
    assert events[-1][2]["status"] == status
    return events


@on_the_services
def test_sessions_ending_in_one_step_wait_for_their_rows_and_their_done_follows_their_tokens(
        settings, tenant, target, new_loop):
    settings.SPECOPS_TOKEN_FLUSH_MS = 60_000  # only the ends flush
    steps, count = 3, 8
    engine = ScriptedEngine(count, steps)
    loop = new_loop(engine)
    jobs = hand_over(loop, tenant, target, count, max_new_tokens=steps * STEP_TOKENS)
    ids = [job.session.pk for job in jobs]

    with token_table_locked():
        loop_thread = stepping(loop)
        wait_for(a_write_waits_on_the_lock, timeout=30, interval=0.02, what="the ends' flush to wait on the lock")
        loop_thread.join(30)
        assert not loop_thread.is_alive() and not loop_thread.failures, loop_thread.failures
        # The loop ran every step and handed over every end without waiting on PostgreSQL;
        # every step is streamed, and no session is ended or woken before its rows commit.
        time.sleep(0.3)
        assert engine.taken == steps and not loop.jobs
        for job in jobs:
            assert [event for _, event, _ in stream_events(job.session.pk)] == ["tokens"] * steps
            assert not job.done.is_set()
        assert set(Session.objects.filter(pk__in=ids).values_list("status", flat=True)) == {"running"}
        assert TokenRecord.objects.filter(session_id__in=ids).count() == 0

    for job in jobs:
        assert job.done.wait(30), "the end was never written"
        assert job.status == "succeeded"
        assert_ended_once(job, "succeeded", steps)
        rows = list(TokenRecord.objects.filter(session_id=job.session.pk).order_by("position")
                    .values_list("position", "step"))
        assert rows == [(position, position // STEP_TOKENS) for position in range(steps * STEP_TOKENS)]
        assert Candidate.objects.filter(session_id=job.session.pk).count() == steps
        session = Session.objects.get(pk=job.session.pk)
        assert session.token_count == steps * STEP_TOKENS and session.stats["batch_rows_max"] == count


def kill_writer_connection(loop) -> None:
    """Terminate the writer thread's own connection: its next statement fails."""
    pids: list[int] = []
    loop.writes.put(backend_pid, pids)
    loop.writes.join()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pids[0]])


@on_the_services
def test_a_flush_whose_connection_was_cut_is_tried_again_and_its_sessions_succeed_once(
        settings, tenant, target, new_loop):
    settings.SPECOPS_TOKEN_FLUSH_MS = 60_000  # one flush, with the sessions' ends
    steps = 2
    loop = new_loop(ScriptedEngine(3, steps))
    jobs = hand_over(loop, tenant, target, 3, max_new_tokens=steps * STEP_TOKENS)
    kill_writer_connection(loop)
    loop_thread = stepping(loop)
    loop_thread.join(30)
    assert not loop_thread.failures, loop_thread.failures
    for job in jobs:
        assert job.done.wait(30) and job.status == "succeeded"
        assert_ended_once(job, "succeeded", steps)
        assert TokenRecord.objects.filter(session_id=job.session.pk).count() == steps * STEP_TOKENS


@on_the_services
def test_a_flush_that_fails_ends_its_sessions_failed_once_and_the_writer_goes_on(
        settings, monkeypatch, tenant, target, new_loop):
    settings.SPECOPS_TOKEN_FLUSH_MS = 60_000
    settings.SPECOPS_SESSION_LEASE_S = 0.5  # no time to try the flush again: it fails its sessions
    monkeypatch.setattr(database_retry, "RETRY_FOR_AT_LEAST_S", 0.0)
    steps = 2
    loop = new_loop(ScriptedEngine(3, steps))
    jobs = hand_over(loop, tenant, target, 3, max_new_tokens=steps * STEP_TOKENS)
    # The writer thread's own connection, then killed under it: its next statement fails.
    pids: list[int] = []
    loop.writes.put(backend_pid, pids)
    loop.writes.join()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pids[0]])

    loop_thread = stepping(loop)
    loop_thread.join(30)
    assert not loop_thread.failures, loop_thread.failures
    for job in jobs:
        assert job.done.wait(30) and job.status == "failed"
        assert_ended_once(job, "failed", steps)
        error = Session.objects.get(pk=job.session.pk).error
        assert error.startswith("recording the outcome failed: OperationalError"), error

    # The writer and the loop outlive it: the next sessions succeed, and the failed flush's rows
    # went again with theirs.
    engine = ScriptedEngine(2, steps)
    loop.engines[(target.pk, None)] = engine
    later = hand_over(loop, tenant, target, 2, max_new_tokens=steps * STEP_TOKENS)
    loop_thread = stepping(loop)
    loop_thread.join(30)
    for job in later:
        assert job.done.wait(30) and job.status == "succeeded"
        assert_ended_once(job, "succeeded", steps)
    for job in jobs + later:
        assert TokenRecord.objects.filter(session_id=job.session.pk).count() == steps * STEP_TOKENS
    assert [event for _, event, _ in stream_events(jobs[0].session.pk)].count("done") == 1


@on_the_services
def test_a_failed_forward_fails_each_of_its_sessions_once(settings, tenant, target, new_loop):
    loop = new_loop(ScriptedEngine(3, 2, fail=RuntimeError("CUDA error: out of memory")))
    jobs = hand_over(loop, tenant, target, 3, max_new_tokens=4)
    loop_thread = stepping(loop)
    loop_thread.join(30)
    for job in jobs:
        assert job.done.wait(30) and job.status == "failed"
        session = Session.objects.get(pk=job.session.pk)
        assert (session.status, session.error) == ("failed", "RuntimeError: CUDA error: out of memory")
        assert [event for _, event, _ in stream_events(job.session.pk)] == ["done"]
    assert not loop.engines


@on_the_services
def test_a_writer_held_up_by_postgresql_stops_the_loop_at_the_queue_bound(settings, tenant, target, new_loop):
    settings.SPECOPS_TOKEN_FLUSH_MS = 1  # a flush after every step
    settings.SPECOPS_SESSION_LEASE_S = 1.5  # renewed every 0.5 s, when the loop can
    steps, bound = 40, 4
    engine = ScriptedEngine(2, steps)
    loop = new_loop(engine, write_queue=bound)
    jobs = hand_over(loop, tenant, target, 2, max_new_tokens=steps * STEP_TOKENS)

    with token_table_locked():
        loop_thread = stepping(loop)
        wait_for(a_write_waits_on_the_lock, timeout=30, interval=0.02, what="a flush to wait on the lock")
        wait_for(lambda: loop.writes.waiting == bound, timeout=30, interval=0.02, what="the queue to fill")
        taken = engine.taken
        for _ in range(20):
            time.sleep(0.05)
            assert loop.writes.waiting <= bound
        assert engine.taken == taken < steps, "the loop must wait for the writer"
        assert loop_thread.is_alive()
        # a loop held up longer than a lease still renews its sessions' leases (the reconciler
        # would otherwise take them for a dead worker's)
        leases = lambda: sorted(Session.objects.filter(pk__in=[job.session.pk for job in jobs])
                                .values_list("lease_expires_at", flat=True))
        held = leases()
        time.sleep(2.5)
        assert engine.taken == taken, "still blocked"
        assert all(later > earlier for earlier, later in zip(held, leases()))
        # the backlog metric saw the queue fill (set after each step the loop could hand over)
        assert bound - 2 <= REGISTRY.get_sample_value("specops_batch_writer_waiting_items") <= bound
        assert REGISTRY.get_sample_value("specops_batch_writer_capacity_items") == bound

    loop_thread.join(60)
    assert not loop_thread.is_alive() and not loop_thread.failures, loop_thread.failures
    for job in jobs:
        assert job.done.wait(30) and job.status == "succeeded"
        assert_ended_once(job, "succeeded", steps)
        assert TokenRecord.objects.filter(session_id=job.session.pk).count() == steps * STEP_TOKENS
