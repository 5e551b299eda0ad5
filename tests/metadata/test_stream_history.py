"""A stream opened late, reopened, or read after Redis lost it: committed history, then live, exactly once.

Steps are published to the real Redis as the worker does (``publish(..., step=)``, entry id
``<step + 1>-0``) and their token rows committed to the real token table; the stream is read
through the real ASGI server (uvicorn) and the OpenAI endpoint of the same server.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx2
import pytest
from rest_framework.authtoken.models import Token

from metadata.models import ModelVersion
from metadata.models import Session, TokenKind, TokenRecord
from metadata.replicas import lsn
from sessions.streams import replay, token_stream
from tests.helpers import wait_for
from tests.inference.api.test_streaming import events, read_stream

pytest_plugins = ["tests.web_process"]  # live_web: one uvicorn server for the run
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

# step -> its token ids (3 steps of 2 tokens, then single tokens)
STEPS = {0: [11, 12], 1: [13, 14], 2: [15, 16], 3: [17], 4: [18], 5: [19]}
KINDS = {0: [TokenKind.TARGET] * 2, 1: [TokenKind.ACCEPTED, TokenKind.BONUS],
         2: [TokenKind.ACCEPTED, TokenKind.CORRECTION]}


@pytest.fixture
def token(api_user) -> str:
    return Token.objects.create(user=api_user).key


@pytest.fixture
def target(db) -> ModelVersion:
    return ModelVersion.objects.create(name="history", version="1", role="target", path="/nonexistent",
                                       context_length=512, status="active")


def new_session(tenant, target, status="running") -> Session:
    return Session.objects.create(tenant=tenant, target=target, drafter="ngram", queue="cpu", prompt="x",
                                  prompt_tokens=1, status=status, finish_reason="length" if status == "succeeded"
                                  else "")


def kinds_of(step: int) -> list[int]:
    return [int(k) for k in KINDS.get(step, [TokenKind.TARGET] * len(STEPS[step]))]


def publish_step(session: Session, step: int) -> None:
    token_stream.publish(session.pk, "tokens", {"step": step, "token_ids": STEPS[step],
                                                "text": "".join(f"<{t}>" for t in STEPS[step]),
                                                "kinds": kinds_of(step)}, step=step)


def commit_steps(session: Session, steps) -> None:
    """The worker's batch writes: whole steps, positions 0..n-1 in step order."""
    position = sum(len(STEPS[s]) for s in STEPS if s < min(steps))
    rows = []
    for step in steps:
        for token_id, kind in zip(STEPS[step], kinds_of(step)):
            rows.append(TokenRecord(session=session, session_created_at=session.created_at, position=position,
                                    step=step, token_id=token_id, piece=f"<{token_id}>", kind=kind))
            position += 1
    TokenRecord.objects.bulk_create(rows)


def publish_done(session: Session, next_step: int, status="succeeded") -> None:
    token_stream.publish(session.pk, "done", {"status": status, "finish_reason": "length", "error": ""},
                         step=next_step)


def tokens_of(messages: list[dict]) -> list[dict]:
    return [json.loads(m["data"]) for m in events(messages) if m["event"] == "tokens"]


def assert_steps(messages: list[dict], steps: list[int]) -> None:
    """Exactly ``steps``, once each and in order, with their ids, data and kinds; then one ``done``."""
    got = events(messages)
    assert [m["event"] for m in got] == ["tokens"] * len(steps) + ["done"], got
    assert [m["id"] for m in got[:-1]] == [token_stream.step_entry_id(s) for s in steps]
    for data, step in zip(tokens_of(messages), steps):
        assert data == {"step": step, "token_ids": STEPS[step], "text": "".join(f"<{t}>" for t in STEPS[step]),
                        "kinds": kinds_of(step)}


def test_a_stream_redis_lost_is_served_from_the_token_table_and_resumes_after_last_event_id(
        live_web, tenant, target, token):
    session = new_session(tenant, target, status="succeeded")
    for step in STEPS:
        publish_step(session, step)
    publish_done(session, len(STEPS))
    commit_steps(session, list(STEPS))
    token_stream.client().delete(token_stream.stream_key(session.pk))  # expired, flushed, evicted

    status, messages = read_stream(live_web, session.pk, token)

    assert status == 200
    assert_steps(messages, list(STEPS))
    assert json.loads(events(messages)[-1]["data"])["status"] == "succeeded"  # from the row
    _, resumed = read_stream(live_web, session.pk, token, **{"Last-Event-ID": token_stream.step_entry_id(2)})
    assert_steps(resumed, [3, 4, 5])
    _, after_the_end = read_stream(live_web, session.pk, token, **{"Last-Event-ID": token_stream.step_entry_id(5)})
    assert_steps(after_the_end, [])


def test_history_then_live_entries_with_no_repeat(live_web, tenant, target, token):
    """Rows committed for steps 0..2, the stream holds 0..5: each step once, then the stream's done."""
    session = new_session(tenant, target)
    for step in STEPS:
        publish_step(session, step)
    commit_steps(session, [0, 1, 2])
    publish_done(session, len(STEPS))

    _, messages = read_stream(live_web, session.pk, token)
    assert_steps(messages, list(STEPS))
    assert events(messages)[-1]["id"] == token_stream.step_entry_id(len(STEPS))  # the worker's done
    _, resumed = read_stream(live_web, session.pk, token, **{"Last-Event-ID": token_stream.step_entry_id(0)})
    assert_steps(resumed, [1, 2, 3, 4, 5])


def test_steps_redis_lost_mid_generation_are_filled_from_the_table_once_committed(live_web, tenant, target, token):
    """Redis lost the stream after step 1 while the worker went on: steps 2 and 3 come from the table."""
    session = new_session(tenant, target)
    for step in (0, 1):
        publish_step(session, step)
    commit_steps(session, [0, 1])
    token_stream.client().delete(token_stream.stream_key(session.pk))

    def worker() -> None:
        time.sleep(0.5)
        publish_step(session, 4)  # steps 2 and 3 went to the lost stream; a fresh one starts at step 4
        time.sleep(1.0)  # the rows of 2..4 commit a flush later
        commit_steps(session, [2, 3, 4])
        publish_step(session, 5)
        commit_steps(session, [5])
        Session.objects.filter(pk=session.pk).update(status="succeeded", finish_reason="length")
        publish_done(session, len(STEPS))

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        _, messages = read_stream(live_web, session.pk, token)
    finally:
        thread.join()
    assert_steps(messages, list(STEPS))


def test_a_gap_that_never_fills_is_passed_after_the_wait_not_waited_on_forever(tenant, target):
    """The reader itself: no rows ever come for step 1, so after ``gap_wait_s`` step 2 goes on."""
    session = new_session(tenant, target)
    publish_step(session, 0)
    token_stream.client().delete(token_stream.stream_key(session.pk))
    publish_step(session, 2)
    publish_done(session, 3)

    async def no_rows(from_step: int) -> list:
        return []

    async def read() -> list:
        items = replay.areplay(session.pk, heartbeat_s=0.2, idle_limit_s=5, committed=no_rows, gap_wait_s=0.5)
        return [(item.id, item.event) async for item in items if isinstance(item, token_stream.StreamEntry)]

    started = time.monotonic()
    got = asyncio.run(read())
    assert got == [("3-0", "tokens"), ("4-0", "done")]
    assert 0.5 <= time.monotonic() - started < 5


def test_without_history_first_the_table_is_read_only_for_what_redis_lacks(tenant, target):
    """``history_first=False`` (a stream opened on a session with no token yet): no table read
    while Redis has every step; when Redis lost them all, the ``done`` still brings them from the
    table, once each and in order."""
    def read(session: Session) -> tuple[list, list[int]]:
        reads: list[int] = []

        async def committed(from_step: int) -> list:
            reads.append(from_step)
            return await asyncio.to_thread(replay.committed_steps, session.pk, from_step)

        async def entries() -> list:
            items = replay.areplay(session.pk, heartbeat_s=0.2, idle_limit_s=5, committed=committed,
                                    history_first=False)
            return [(item.id, item.event) async for item in items if isinstance(item, token_stream.StreamEntry)]

        return asyncio.run(entries()), reads

    expected = [(token_stream.step_entry_id(s), "tokens") for s in (0, 1, 2)] + [("4-0", "done")]
    whole = new_session(tenant, target)
    commit_steps(whole, [0, 1, 2])
    for step in (0, 1, 2):
        publish_step(whole, step)
    publish_done(whole, 3)
    assert read(whole) == (expected, [3])  # only the done's check for steps the stream lost

    lost = new_session(tenant, target)
    commit_steps(lost, [0, 1, 2])
    publish_done(lost, 3)  # the tokens' entries never reached this stream
    assert read(lost) == (expected, [0])


def test_committed_steps_groups_rows_by_step_from_the_asked_step(tenant, target):
    session = new_session(tenant, target)
    commit_steps(session, [0, 1, 2])

    entries = replay.committed_steps(session.pk, 1)

    assert [(e.id, e.event, e.data["step"], e.data["token_ids"]) for e in entries] == [
        ("2-0", "tokens", 1, [13, 14]), ("3-0", "tokens", 2, [15, 16])]
    assert entries[0].data["kinds"] == [TokenKind.ACCEPTED, TokenKind.BONUS]
    assert replay.committed_steps(session.pk, 3) == []


def test_the_openai_reply_has_every_step_though_redis_lost_some(live_web, tiny_model, api_user, token):
    """A non-streaming completion follows its session's stream; Redis lost steps 0..4 on the way."""
    def worker() -> None:
        with lsn.primary_only():  # a thread of its own: the fixture's primary-only reads do not reach it
            simulate(wait_for(lambda: Session.objects.filter(created_by=api_user).first(), timeout=30,
                              what="the completion's session"))

    def simulate(session: Session) -> None:
        commit_steps(session, list(range(5)))  # their stream entries were lost
        publish_step(session, 5)
        commit_steps(session, [5])
        Session.objects.filter(pk=session.pk).update(status="succeeded", finish_reason="length")
        publish_done(session, len(STEPS))

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        response = httpx2.post(f"{live_web.url}/v1/completions", headers={"Authorization": f"Bearer {token}"},
                               json={"model": "tiny", "prompt": "x = 1\n", "max_tokens": 9, "temperature": 0},
                               timeout=60)
    finally:
        thread.join()
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == sum(len(ids) for ids in STEPS.values())
