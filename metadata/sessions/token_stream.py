"""Per-session token streams in Redis Streams: the worker appends, API clients follow.

A Redis Stream (not pub/sub) so a client that connects late replays from the start and never
misses a token; the key expires an hour after the last write. Events: ``tokens``
``{step, token_ids, text}`` per verification step, then ``done`` ``{status, finish_reason, error}``.

``afollow`` is the reader of the async web server (redis.asyncio, one blocking ``XREAD`` per
open stream, no thread): it resumes after a given entry id (the SSE ``Last-Event-ID``), reports
quiet intervals so the caller can send heartbeats, asks the caller whether a quiet session has
ended without a ``done`` entry (its worker died, it was cancelled, its stream expired), and
gives up after an idle limit. ``follow`` is the blocking reader for scripts and tests.
"""
from __future__ import annotations

import asyncio
import json
import re
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from django.conf import settings

STREAM_TTL_S = 3600
_client: redis.Redis | None = None


def client() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
    return _client


def stream_key(session_id) -> str:
    return f"specops:stream:{session_id}"


def step_entry_id(step: int) -> str:
    """The stream entry id of step `step` (0-based): "<step + 1>-0". A `done` event takes the id
    the next step would have had, so ids follow the generation, not the clock."""
    return f"{step + 1}-0"


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One event to append to a session's stream; with ``step``, under that step's entry id."""

    session_id: Any
    event: str
    data: dict[str, Any]
    step: int | None = None


def publish(session_id, event: str, data: dict, *, step: int | None = None) -> bool:
    """Append an event; with `step`, under that step's entry id, exactly once.

    Redis refuses an XADD whose id is not above the stream's last one, so a resumed run that
    publishes a step the stream already holds adds nothing (returns False).
    """
    return publish_many([StreamEvent(session_id, event, data, step)])[0]


def publish_many(events: list[StreamEvent]) -> list[bool]:
    """Append several events, of any sessions, in one round trip; per event, whether it was added.

    What a batch step streams: one MULTI/EXEC for all its rows instead of one per row (each
    event exactly once by its step's entry id, as in `publish`). A refused duplicate leaves the
    others added, and its stream's expiry is renewed all the same.
    """
    if not events:
        return []
    pipe = client().pipeline()
    for item in events:
        key = stream_key(item.session_id)
        pipe.xadd(key, {"event": item.event, "data": json.dumps(item.data)},
                  id=step_entry_id(item.step) if item.step is not None else "*")
        pipe.expire(key, STREAM_TTL_S)
    results = pipe.execute(raise_on_error=False)
    added = []
    for result in results[::2]:  # each XADD's reply; the EXPIRE after it runs either way
        if isinstance(result, redis.ResponseError):
            if "equal or smaller" not in str(result):
                raise result
            added.append(False)
        else:
            added.append(True)
    return added


def forget_after(session_id, step: int) -> int:
    """Delete the events after step `step` (those a crashed run streamed but never committed),
    so a resumed run publishes them again from what it generates; returns how many went."""
    key = stream_key(session_id)
    entries = client().xrange(key, min=f"({step_entry_id(step)}", max="+")
    if entries:
        pipe = client().pipeline()  # MULTI/EXEC: nobody sees the stream between the two
        pipe.xdel(key, *[entry_id for entry_id, _ in entries])
        # XDEL leaves the stream's last id where it was, and XADD refuses ids at or below it:
        # without this the resumed run's steps up to the crashed run's last one would be dropped.
        pipe.execute_command("XSETID", key, step_entry_id(step))
        pipe.execute()
    return len(entries)


def follow(session_id, block_ms: int = 1000, idle_limit: int = 60) -> Iterator[tuple[str, dict]]:
    """Yield (event, data) from the start until a ``done`` event or ``idle_limit`` empty reads."""
    key = stream_key(session_id)
    last_id = "0-0"
    idle = 0
    while idle < idle_limit:
        batches = client().xread({key: last_id}, block=block_ms, count=100)
        if not batches:
            idle += 1
            continue
        idle = 0
        for _key, entries in batches:
            for entry_id, fields in entries:
                last_id = entry_id
                event = fields[b"event"].decode()
                yield event, json.loads(fields[b"data"])
                if event == "done":
                    return


# ---- async reading (the ASGI web server) ------------------------------------------------------

ENTRY_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
HEARTBEAT = "heartbeat"  # afollow: nothing new for heartbeat_s
IDLE_LIMIT = "idle_limit"  # afollow: nothing new for idle_limit_s; the last item

_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, redis.asyncio.Redis] = (
    weakref.WeakKeyDictionary())


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One event of a session's stream; ``id`` is its Redis entry id ("" for a synthesized ``done``)."""

    id: str
    event: str
    data: dict[str, Any]


def is_entry_id(value: str) -> bool:
    return bool(ENTRY_ID.fullmatch(value))


def async_client() -> redis.asyncio.Redis:
    """This event loop's client (redis.asyncio connections belong to the loop that made them)."""
    loop = asyncio.get_running_loop()
    client_ = _async_clients.get(loop)
    if client_ is None:
        from core.conf import conf

        # One connection per open stream (each blocks in XREAD on its own key, woken by Redis when
        # that key grows); no socket timeout: a read blocks server-side up to a heartbeat interval.
        client_ = redis.asyncio.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=5, socket_timeout=None,
                                               max_connections=conf.STREAM_REDIS_CONNECTIONS)
        _async_clients[loop] = client_
    return client_


def _entries(batches) -> list[StreamEntry]:
    return [StreamEntry(entry_id.decode(), fields[b"event"].decode(), json.loads(fields[b"data"]))
            for _key, entries in batches or () for entry_id, fields in entries]


async def afollow(session_id, after: str = "0-0", *, heartbeat_s: float, idle_limit_s: float,
                  ended: Callable[[], Awaitable[dict | None]] | None = None,
                  ) -> AsyncIterator[StreamEntry | str]:
    """Yield the stream's entries after entry id ``after`` until ``done`` (the last item).

    ``HEARTBEAT`` comes after each ``heartbeat_s`` without an entry, ``IDLE_LIMIT`` (the last item)
    after ``idle_limit_s``. ``ended`` is asked when the stream is quiet (right away if the first
    read finds nothing, then at each heartbeat): it returns the ``done`` data of a session that
    has ended, which is yielded as a synthesized ``done`` once the stream is drained.
    """
    key = stream_key(session_id)
    client_ = async_client()
    loop = asyncio.get_running_loop()
    last_id, quiet_since, block_ms = after, loop.time(), None  # the first read does not block
    while True:
        entries = _entries(await client_.xread({key: last_id}, block=block_ms, count=100))
        for entry in entries:
            last_id = entry.id
            yield entry
            if entry.event == "done":
                return
        if entries:
            quiet_since, block_ms = loop.time(), _block_ms(heartbeat_s, idle_limit_s, 0.0)
            continue
        final = await ended() if ended is not None else None
        if final is not None:
            # Whatever was published between the read and the check comes first.
            for entry in _entries(await client_.xread({key: last_id}, count=10_000)):
                yield entry
                if entry.event == "done":
                    return
            yield StreamEntry("", "done", final)
            return
        quiet = loop.time() - quiet_since
        if quiet >= idle_limit_s:
            yield IDLE_LIMIT
            return
        if block_ms is not None:
            yield HEARTBEAT
        block_ms = _block_ms(heartbeat_s, idle_limit_s, quiet)


def _block_ms(heartbeat_s: float, idle_limit_s: float, quiet_s: float) -> int:
    return max(1, int(min(heartbeat_s, idle_limit_s - quiet_s) * 1000))


def ended_event(session_id) -> dict | None:
    """The ``done`` data of a session that has finished, failed or been cancelled, else None (sync).

    Reads the session's state through the two-tier cache, and the row only once it has ended.
    """
    from metadata.models import LIVE_STATUSES, Session
    from metadata.sessions.state import get_session_state

    state = get_session_state(session_id)
    if state is None:
        return {"status": "failed", "finish_reason": "", "error": "the session no longer exists."}
    if state["status"] in LIVE_STATUSES:
        return None
    row = Session.objects.filter(pk=session_id).values("status", "finish_reason", "error").first()
    return row if row is not None and row["status"] not in LIVE_STATUSES else None
