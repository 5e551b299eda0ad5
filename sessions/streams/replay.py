"""A session's stream with its history: the committed steps from the token table, then the live ones.

Redis holds a session's stream for an hour, and a flush or an eviction can lose it at any time;
the token table is the record. A client that opens (or reopens, with ``Last-Event-ID``) a stream
late therefore reads the committed steps from the table first, each as the ``tokens`` event the
worker published for it (same entry id ``step_entry_id(step)``, same data ``{step, token_ids,
text, kinds}``), then follows the live stream after the last of them:

* no repeat: a step is yielded once, in step order (entries are compared by id, and a live step
  at or below the last one yielded is skipped);
* no gap: a live step beyond the next expected one means Redis lost the steps between (the key
  was flushed or expired while the worker went on); they are read from the table once their
  rows commit (within a flush interval), and only after ``GAP_WAIT_S`` without them is the gap
  accepted and logged;
* the end: before ``done`` (the worker's, or one synthesized from the ended session's row), any
  committed step the stream no longer holds is yielded.

A history event's ``text`` joins the stored pieces of its tokens, so it shows NUL as U+2400 as the
token table does (the worker's live ``text`` decodes the ids); the ids are the truth in both.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from itertools import groupby

from django.db.models import Subquery

from metadata.ids import created_at_of
from metadata.models import Session, TokenRecord
from sessions.streams import token_stream
from sessions.streams.stream_hub import parse_entry_id
from sessions.streams.token_stream import StreamEntry, step_entry_id

logger = logging.getLogger(__name__)

GAP_WAIT_S = 5.0  # how long a live step may wait for the rows of the steps Redis lost before it
GAP_POLL_S = 0.2

Committed = Callable[[int], Awaitable[list[StreamEntry]]]


def committed_steps(session_id, from_step: int = 0) -> list[StreamEntry]:
    """The session's committed steps from ``from_step`` on, as ``tokens`` stream entries (sync).

    One query, pruned to one partition: the partition key is the time a UUIDv7 id carries, or
    for an older id comes from the session row (a scalar subquery the planner prunes by at run time).
    """
    created_at = created_at_of(session_id) or Subquery(  # an InitPlan
        Session.objects.filter(pk=session_id).values("created_at")[:1])
    rows = (TokenRecord.objects.filter(session_id=session_id, session_created_at=created_at, step__gte=from_step)
            .order_by("position").values_list("step", "token_id", "piece", "kind"))
    entries = []
    for step, tokens in groupby(rows, key=lambda row: row[0]):
        tokens = list(tokens)
        entries.append(StreamEntry(step_entry_id(step), "tokens", {
            "step": step, "token_ids": [row[1] for row in tokens], "text": "".join(row[2] for row in tokens),
            "kinds": [row[3] for row in tokens]}))
    return entries


def step_of(entry: StreamEntry) -> int | None:
    """The step of a ``tokens`` entry published under its step's id, else None (an auto id)."""
    step = entry.data.get("step") if entry.event == "tokens" else None
    if isinstance(step, int) and not isinstance(step, bool) and entry.id == step_entry_id(step):
        return step
    return None


class _Position:
    """How far a reader has got: the last entry id yielded and the next step it expects."""

    def __init__(self, after: str) -> None:
        self.id = after
        # step s has id (s + 1, 0), which is after (ms, seq) exactly when s >= ms
        self.next_step = parse_entry_id(after)[0]

    def passed(self, entry: StreamEntry) -> None:
        if entry.id and parse_entry_id(entry.id) > parse_entry_id(self.id):
            self.id = entry.id
        step = step_of(entry)
        if step is not None:
            self.next_step = max(self.next_step, step + 1)


async def areplay(session_id, after: str = "0-0", *, heartbeat_s: float, idle_limit_s: float,
                  committed: Committed, ended: Callable[[], Awaitable[dict | None]] | None = None,
                  gap_wait_s: float = GAP_WAIT_S, history_first: bool = True) -> AsyncIterator[StreamEntry | str]:
    """Yield the session's events after entry id ``after``: history, then live, then ``done``.

    Items as ``token_stream.afollow``'s (``StreamEntry``, ``HEARTBEAT``, ``IDLE_LIMIT``).
    ``committed(from_step)`` returns the committed steps from ``from_step`` on (the caller runs
    ``committed_steps`` off the event loop: ``run_db``); ``ended`` as for ``afollow``.
    ``history_first=False`` skips the first read of the table, for a session that has made no
    token yet (just submitted): a step Redis lacks is still read from the table, at the gap it
    leaves or at the ``done``, so the skip costs nothing but that query when it was wrong.
    """
    position = _Position(after)
    for entry in (await committed(position.next_step) if history_first else ()):
        position.passed(entry)
        yield entry
    while True:
        gap: StreamEntry | None = None
        items = token_stream.afollow(session_id, position.id, heartbeat_s=heartbeat_s, idle_limit_s=idle_limit_s,
                                     ended=ended)
        async with aclosing(items):
            async for item in items:
                if not isinstance(item, StreamEntry):
                    yield item  # HEARTBEAT, or IDLE_LIMIT (the last item)
                    continue
                step = step_of(item)
                if step is not None and step < position.next_step:
                    continue  # already yielded (from the table)
                if step is not None and step > position.next_step:
                    gap = item
                    break
                if item.event == "done":
                    for entry in await committed(position.next_step):  # steps the stream lost
                        position.passed(entry)
                        yield entry
                position.passed(item)
                yield item
                if item.event == "done":
                    return
        if gap is None:
            return  # the idle limit
        filled = await _fill(position, committed, gap, gap_wait_s)
        for entry in filled:
            position.passed(entry)
            yield entry
        if not filled:
            logger.warning("stream of session %s: steps %d..%d are neither in Redis nor committed after %g s; "
                           "going on without them", session_id, position.next_step, step_of(gap) - 1, gap_wait_s)
            position.passed(gap)
            yield gap


async def _fill(position: _Position, committed: Committed, gap: StreamEntry, wait_s: float) -> list[StreamEntry]:
    """The committed steps from the next expected one, waiting (up to ``wait_s``) for their rows."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        entries = await committed(position.next_step)
        if entries or loop.time() >= deadline:
            return entries
        await asyncio.sleep(GAP_POLL_S)
