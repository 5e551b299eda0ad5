"""What a client was streamed is what the session stores: a run that takes over adopts the steps
an earlier run streamed but never committed, instead of making those positions again.

The fast tests play two runs of one session on the real PostgreSQL and Redis (the first streams
more steps than it commits, the second claims the session) and check what the second resumes
from, what rows it writes and what the first can still publish. The slow one pauses a real
worker past its lease while a client follows a sampled session's stream over the real web
server: everything the client was streamed must be a prefix of the tokens the session stores.
"""
from __future__ import annotations

import json
import os
import signal
import threading
from datetime import timedelta

import httpx2
import pytest
from rest_framework.authtoken.models import Token

from inference.engine.batch.engine import RowEvent
from inference.engine.outputs import Branch, StepOutput
from inference.engine.stats import GenerationStats
from metadata.models import ModelVersion
from sessions.runs.adoption import start_stream
from inference.worker.lifecycle import finished_before, prepare
from sessions.runs import claim_session, committed_tokens, database_now
from inference.worker.recorder import BatchRecorder, SessionRecorder
from metadata.models import Candidate, Session, TokenKind, TokenRecord
from metadata.replicas import lsn
from sessions.streams import token_stream
from tests.helpers import claim, wait_for

pytest_plugins = ["tests.web_process"]  # live_web: one uvicorn server for the run

LEASE_S = 3


@pytest.fixture(autouse=True)
def short_leases(settings):
    settings.SPECOPS_SESSION_LEASE_S = LEASE_S
    with lsn.primary_only():
        yield


@pytest.fixture
def target(db) -> ModelVersion:
    return ModelVersion.objects.create(name="adopting", version="1", role="target", path="/nonexistent",
                                       context_length=512, status="active")


@pytest.fixture
def streams():
    """Session ids whose stream and fence keys go at the end of the test."""
    made = []
    yield made
    for session_id in made:
        token_stream.client().delete(token_stream.stream_key(session_id), token_stream.fence_key(session_id))


def decode(ids) -> str:
    return "".join(chr(97 + token % 26) for token in ids)


def new_session(tenant, target, streams, **fields) -> Session:
    session = Session.objects.create(**{"tenant": tenant, "target": target, "drafter": "ngram", "queue": "adopt-idle",
                                        "prompt": "x", "prompt_tokens": 1, "params": {"max_new_tokens": 8}, **fields})
    streams.append(session.pk)
    return session


def lapse(session: Session) -> None:
    Session.objects.filter(pk=session.pk).update(lease_expires_at=database_now() - timedelta(seconds=1))


def step(session_id, tokens: list[int]) -> RowEvent:
    """A step that verified a draft of two and accepted one (kinds: accepted, then correction)."""
    return RowEvent(session_id, StepOutput(tokens, drafted=2, accepted=1, branches=[Branch(tuple(tokens), -0.5, 1)]),
                    GenerationStats())


def rows_of(session_id) -> list[tuple[int, int, int, int]]:
    return list(TokenRecord.objects.filter(session_id=session_id).order_by("position")
                .values_list("position", "step", "token_id", "kind"))


def streamed_tokens(session_id) -> list[tuple[int, list[int]]]:
    entries = token_stream.client().xrange(token_stream.stream_key(session_id))
    return [(data["step"], data["token_ids"]) for data in
            (json.loads(fields[b"data"]) for _id, fields in entries if fields[b"event"] == b"tokens")]


def first_run_streams_past_its_commit(session: Session) -> SessionRecorder:
    """Run 1 (fence 1): steps 0..2 streamed, only step 0's rows committed."""
    assert claim(session) == 1
    batch = BatchRecorder()
    recorder = SessionRecorder(session, decode)
    events = [recorder.record(step(session.pk, [1, 2]), batch.writer)]
    assert batch.write(batch.take([recorder])) == set()
    events += [recorder.record(step(session.pk, tokens), batch.writer) for tokens in ([3, 4], [5, 6])]
    assert token_stream.publish_fenced(events) == [token_stream.ADDED] * 3
    return recorder


def test_a_run_that_takes_over_resumes_after_the_steps_the_old_run_streamed(tenant, target, streams):
    session = new_session(tenant, target, streams)
    old = first_run_streams_past_its_commit(session)
    lapse(session)  # paused past its lease
    again = Session.objects.get(pk=session.pk)
    assert claim(again) == 2
    committed, next_step = committed_tokens(again)
    assert (committed, next_step) == ([1, 2], 1)

    assert start_stream(again, committed, next_step, decode) == ([1, 2, 3, 4, 5, 6], 3)

    accepted, correction = TokenKind.ACCEPTED, TokenKind.CORRECTION
    assert rows_of(session.pk) == [(0, 0, 1, accepted), (1, 0, 2, correction), (2, 1, 3, accepted),
                                   (3, 1, 4, correction), (4, 2, 5, accepted), (5, 2, 6, correction)]
    assert list(TokenRecord.objects.filter(session_id=session.pk).values_list("piece", flat=True)) == list("bcdefg")
    assert Candidate.objects.filter(session_id=session.pk).count() == 1  # step 0's: the stream carries none
    # the paused run wakes: its next step is refused; the new run's first step follows the adopted ones
    late = old.record(step(session.pk, [7, 8]), BatchRecorder().writer)
    assert token_stream.publish_fenced([late]) == [token_stream.STALE]
    assert token_stream.publish(session.pk, "tokens", {"step": 3, "token_ids": [9]}, step=3, fence=2)
    assert streamed_tokens(session.pk) == [(0, [1, 2]), (1, [3, 4]), (2, [5, 6]), (3, [9])]


def test_a_claim_adopts_steps_up_to_a_gap_and_drops_the_steps_after_it(tenant, target, streams):
    """Redis lost step 2 (a restart while the run went on): steps after the gap cannot be adopted."""
    session = new_session(tenant, target, streams)
    for number in (0, 1, 3):
        token_stream.publish(session.pk, "tokens", {"step": number, "token_ids": [number]}, step=number, fence=1)

    start = token_stream.begin_run(session.pk, 2, 0)

    assert [entry.data["step"] for entry in start.adopted] == [1] and start.dropped == 1
    assert token_stream.publish(session.pk, "tokens", {"step": 2, "token_ids": [20]}, step=2, fence=2)
    assert streamed_tokens(session.pk) == [(0, [0]), (1, [1]), (2, [20])]


def test_a_run_whose_claim_was_overtaken_adopts_nothing_and_writes_no_row(tenant, target, streams):
    session = new_session(tenant, target, streams)
    first_run_streams_past_its_commit(session)
    token_stream.raise_fence(session.pk, 3)  # a third run's turn already

    assert start_stream(session, [1, 2], 1, decode) == ([1, 2], 1)
    assert [row[2] for row in rows_of(session.pk)] == [1, 2]
    assert len(streamed_tokens(session.pk)) == 3  # nothing deleted either


def test_a_run_whose_fence_went_stale_after_its_stream_began_writes_no_adopted_row(tenant, target, streams):
    session = new_session(tenant, target, streams)
    first_run_streams_past_its_commit(session)
    lapse(session)
    again = Session.objects.get(pk=session.pk)
    claim(again)
    Session.objects.filter(pk=session.pk).update(attempts=3)  # a third claim between the stream and the rows

    assert start_stream(again, [1, 2], 1, decode)[0] == [1, 2, 3, 4, 5, 6]
    assert [row[2] for row in rows_of(session.pk)] == [1, 2]


def test_prepare_resumes_from_the_adopted_steps_and_ends_at_once_when_they_end_the_generation(
        tenant, tiny_model, streams):
    token_ids = [11, 12, 13, 14, 15, 16]
    session = new_session(tenant, tiny_model, streams, params={"max_new_tokens": 6})
    claimed = claim_session(session.pk)
    batch = BatchRecorder()
    recorder = SessionRecorder(claimed, decode)
    events = [recorder.record(step(session.pk, token_ids[i:i + 2]), batch.writer) for i in (0, 2, 4)]
    token_stream.publish_fenced(events)  # all streamed, none committed
    lapse(session)

    job = prepare(claim_session(session.pk))

    assert job.request.resume_ids == tuple(token_ids) and job.recorder.step == 3
    assert job.recorder.token_ids == token_ids
    assert [row[2] for row in rows_of(session.pk)] == token_ids
    assert finished_before(job) == "length"  # the old run streamed the last step: nothing left to make


def test_a_session_the_reconciler_fails_stores_what_its_last_run_streamed(
        tenant, tiny_model, streams, settings, django_capture_on_commit_callbacks):
    from inference.engine.lm.loading import load_tokenizer
    from sessions.runs.reconciler import reconcile_sessions

    settings.SPECOPS_MAX_ATTEMPTS = 1  # its worker lost once is one time too many
    session = new_session(tenant, tiny_model, streams)
    old = first_run_streams_past_its_commit(session)
    lapse(session)

    with django_capture_on_commit_callbacks(execute=True):  # the end's done goes out on its commit
        assert reconcile_sessions().failed == [str(session.pk)]

    ended = Session.objects.get(pk=session.pk)
    assert (ended.status, ended.token_count) == ("failed", 6)
    assert ended.text == load_tokenizer(tiny_model.directory).decode([1, 2, 3, 4, 5, 6])
    assert [(row[1], row[2]) for row in rows_of(session.pk)] == [(0, 1), (0, 2), (1, 3), (1, 4), (2, 5), (2, 6)]
    late = old.record(step(session.pk, [7, 8]), BatchRecorder().writer)
    assert token_stream.publish_fenced([late]) == [token_stream.STALE]  # the lost run wakes: nothing more
    entries = token_stream.client().xrange(token_stream.stream_key(session.pk))
    assert [(entry_id.decode(), fields[b"event"].decode()) for entry_id, fields in entries] == [
        ("1-0", "tokens"), ("2-0", "tokens"), ("3-0", "tokens"), ("4-0", "done")]


def test_a_run_over_its_attempts_fails_the_session_with_what_the_last_run_streamed(tenant, tiny_model, streams,
                                                                                  settings):
    from inference.worker.lifecycle import run_session

    settings.SPECOPS_MAX_ATTEMPTS = 1
    session = new_session(tenant, tiny_model, streams)
    first_run_streams_past_its_commit(session)
    lapse(session)  # a delivery of its task claims it a second time, one time too many

    assert run_session(str(session.pk), submit=lambda job: pytest.fail("a run over its attempts generated")) == "failed"

    ended = Session.objects.get(pk=session.pk)
    assert (ended.status, ended.attempts, ended.token_count) == ("failed", 2, 6)
    assert ended.error.startswith("gave up after 1 attempts")
    assert [row[2] for row in rows_of(session.pk)] == [1, 2, 3, 4, 5, 6]
    assert streamed_tokens(session.pk) == [(0, [1, 2]), (1, [3, 4]), (2, [5, 6])]


# ---- a real worker paused past its lease, a client following the stream -------------------------


class Follower(threading.Thread):
    """An SSE client of the session's stream from its first event, as an application would be:
    it reconnects with ``Last-Event-ID`` when the server ends the stream without ``done``."""

    def __init__(self, base_url: str, token: str, session_id: str) -> None:
        super().__init__(name=f"follower-{session_id}", daemon=True)
        self.url = f"{base_url}/api/v1/sessions/{session_id}/stream/"
        self.token = token
        self.steps: list[tuple[int, list[int]]] = []
        self.done: dict | None = None
        self.stop = threading.Event()

    @property
    def tokens(self) -> list[int]:
        return [token for _step, ids in self.steps for token in ids]

    def run(self) -> None:
        last_id = None
        while self.done is None and not self.stop.is_set():
            headers = {"Authorization": f"Token {self.token}", **({"Last-Event-ID": last_id} if last_id else {})}
            with httpx2.stream("GET", self.url, headers=headers, timeout=30) as response:
                event = data = entry_id = None
                for line in response.iter_lines():
                    if line.startswith("event:"):
                        event = line.partition(":")[2].strip()
                    elif line.startswith("data:"):
                        data = json.loads(line.partition(":")[2])
                    elif line.startswith("id:"):
                        entry_id = line.partition(":")[2].strip()
                    elif line == "" and event is not None:
                        if event == "tokens":
                            self.steps.append((data["step"], data["token_ids"]))
                        elif event == "done":
                            self.done = data
                        last_id = entry_id or last_id
                        event = data = entry_id = None


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_sampled_session_paused_past_its_lease_stores_every_token_its_client_was_streamed(
        api_client, api_user, tiny_model, live_web, tmp_path, settings):
    from specops.celery import app
    from tests.inference.worker.test_crash_safety import nonce_prompt
    from tests.worker_process import start_worker, stop_worker
    from sessions.runs.reconciler import reconcile_sessions

    settings.SPECOPS_MAX_ATTEMPTS = 3
    app.control.purge()
    # Rows commit 10 s after the first flush at most (none fills up): what the client is streamed
    # before the pause has no rows yet, beyond the first flush's.
    worker = start_worker("cpu", "adopting", tmp_path / "adopting.log", extra_env={
        "SPECOPS_SESSION_LEASE_S": str(LEASE_S), "SPECOPS_TOKEN_FLUSH_MS": "10000",
        "SPECOPS_TOKEN_BATCH_SIZE": "100000", "OMP_NUM_THREADS": "1"})
    paused, follower = False, None
    try:
        created = api_client.post("/api/v1/generations/", {
            "prompt": nonce_prompt("def parse(text):\n    "), "max_new_tokens": 400, "temperature": 1.0,
            "drafter": "draft_model"}, format="json")
        assert created.status_code == 202, created.content
        session_id = created.json()["id"]
        follower = Follower(live_web.url, Token.objects.get(user=api_user).key, session_id)
        follower.start()
        wait_for(lambda: len(follower.steps) >= 3, timeout=60, interval=0.005, what="three streamed steps")
        os.killpg(worker.pid, signal.SIGSTOP)
        paused = True
        seen, rows = len(follower.tokens), TokenRecord.objects.filter(session_id=session_id).count()
        assert Session.objects.get(pk=session_id).status == "running", "it ended before the pause"
        wait_for(lambda: session_id in reconcile_sessions().resumed, timeout=LEASE_S + 20, interval=0.5,
                 what="the reconciler to re-queue the paused session")
        os.killpg(worker.pid, signal.SIGCONT)  # the paused run wakes; the re-queued task resumes here
        paused = False
        wait_for(lambda: follower.done is not None, timeout=120, what="the client's done event")
    finally:
        if paused:
            os.killpg(worker.pid, signal.SIGCONT)
        stop_worker(worker)
        if follower is not None:
            follower.stop.set()

    assert rows < seen, f"the pause came after the rows of every streamed token ({rows} of {seen}) committed"
    ended = Session.objects.get(pk=session_id)
    stored = list(TokenRecord.objects.filter(session_id=session_id).order_by("position")
                  .values_list("token_id", flat=True))
    assert (ended.status, ended.attempts, ended.token_count) == ("succeeded", 2, len(stored))
    assert follower.done["status"] == "succeeded"
    assert [number for number, _ in follower.steps] == list(range(len(follower.steps)))
    assert follower.tokens == stored  # every token the client was streamed, in order, and no other
