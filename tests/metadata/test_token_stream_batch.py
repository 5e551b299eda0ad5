"""One round trip for a batch step's stream events: every row's step exactly once, as `publish`.

Against the tests' real Redis. The batching loop publishes the `tokens` events of all rows of a
step with `publish_many`, then ends the rows that finished (their `done` after their last step).
"""
from __future__ import annotations

import uuid

import pytest

from sessions.streams import token_stream
from sessions.streams.token_stream import StreamEvent


@pytest.fixture
def sessions():
    ids = [uuid.uuid4() for _ in range(3)]
    yield ids
    token_stream.client().delete(*[token_stream.stream_key(i) for i in ids])


def entries(session_id) -> list[tuple[str, str, dict]]:
    import json

    return [(entry_id.decode(), fields[b"event"].decode(), json.loads(fields[b"data"]))
            for entry_id, fields in token_stream.client().xrange(token_stream.stream_key(session_id))]


def tokens(session_id, step: int) -> StreamEvent:
    return StreamEvent(session_id, "tokens", {"step": step, "token_ids": [step]}, step=step)


def test_publish_many_appends_each_rows_step_under_its_entry_id(sessions):
    a, b, c = sessions
    assert token_stream.publish_many([tokens(a, 0), tokens(b, 0), tokens(c, 0)]) == [True] * 3
    assert token_stream.publish_many([tokens(a, 1), tokens(b, 1)]) == [True, True]
    assert [entry_id for entry_id, _, _ in entries(a)] == ["1-0", "2-0"]
    assert entries(c) == [("1-0", "tokens", {"step": 0, "token_ids": [0]})]
    assert all(0 < token_stream.client().ttl(token_stream.stream_key(s)) <= token_stream.STREAM_TTL_S
               for s in sessions)


def test_a_step_already_streamed_is_refused_alone_and_the_others_go_in(sessions):
    """A resumed run re-publishing a step the stream holds adds nothing; its companions' steps
    in the same round trip are added all the same, and the refused stream's expiry renewed."""
    a, b, _ = sessions
    token_stream.publish_many([tokens(a, 0), tokens(a, 1)])
    token_stream.client().persist(token_stream.stream_key(a))
    added = token_stream.publish_many([tokens(a, 1), tokens(b, 0),
                                       StreamEvent(a, "done", {"status": "succeeded"}, step=2)])
    assert added == [False, True, True]
    assert [event for _, event, _ in entries(a)] == ["tokens", "tokens", "done"]
    assert token_stream.client().ttl(token_stream.stream_key(a)) > 0
    assert token_stream.publish(a, "tokens", {"step": 1}, step=1) is False


def test_publish_many_of_nothing_sends_nothing():
    assert token_stream.publish_many([]) == []
