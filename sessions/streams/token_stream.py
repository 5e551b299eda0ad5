"""Per-session token streams in Redis Streams: the worker appends, API clients follow.

A Redis Stream (not pub/sub) so a client that connects late replays from the start and never
misses a token; the key expires an hour after the last write. Events: ``tokens``
``{step, token_ids, text}`` per verification step, then ``done`` ``{status, finish_reason, error}``
(and ``cached_tokens`` when the prefix cache held some of the prompt).

``afollow`` is the reader of the async web server (redis.asyncio, no thread; after its first read
the process's stream hub reads for it, one blocking ``XREAD`` for all open streams): it resumes after a given entry id (the SSE ``Last-Event-ID``), reports
quiet intervals so the caller can send heartbeats, asks the caller whether a quiet session has
ended without a ``done`` entry (its worker died, it was cancelled, its stream expired), and
gives up after an idle limit.

Fencing: a worker's run of a session writes under a fence, the ``attempts`` number its claim
returned. Every append goes through one Lua script (`publish_many`) that refuses an event whose
fence is below the one recorded beside the stream (``specops:stream:<id>:fence``); a claim
records its fence and reads the steps earlier runs streamed past the committed tokens in the same
script (`begin_run`), so a paused run that wakes after another run took the session over cannot
append a late step, and the new run adopts every step a client may have seen. A ``done`` seals
the stream: no run's event follows it.
"""
from __future__ import annotations

import asyncio
import json
import os
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from django.conf import settings

from sessions.streams import stream_hub
from sessions.streams.stream_hub import StreamEntry

STREAM_TTL_S = 3600
SEALED = 1 << 40  # the fence a done records: above every run's (attempts is a smallint)
_client: redis.Redis | None = None
_scripts: dict[str, Any] = {}

# KEYS: stream, fence key, per event. ARGV: ttl, then per event: fence ("" = unfenced), entry id
# ("*" = the clock's), event, data, seal ("1" after a done). Per event: 1 added, 0 a duplicate
# step (the id is not above the stream's last), -1 refused (the event's fence is stale).
_PUBLISH_LUA = """
local ttl = tonumber(ARGV[1])
local sealed = ARGV[2]
local out = {}
for i = 1, #KEYS / 2 do
  local stream, fence_key = KEYS[2 * i - 1], KEYS[2 * i]
  local base = 2 + (i - 1) * 5
  local fence, id, event, data, seal = ARGV[base + 1], ARGV[base + 2], ARGV[base + 3], ARGV[base + 4], ARGV[base + 5]
  local recorded = tonumber(redis.call('GET', fence_key) or '0')
  if fence ~= '' and tonumber(fence) < recorded then
    out[i] = -1
  else
    local added = redis.pcall('XADD', stream, id, 'event', event, 'data', data)
    if type(added) == 'table' and added.err then
      if not string.find(added.err, 'equal or smaller', 1, true) then
        return redis.error_reply(added.err)
      end
      out[i] = 0
    else
      out[i] = 1
    end
    redis.call('EXPIRE', stream, ttl)
    if seal == '1' then
      redis.call('SET', fence_key, sealed, 'EX', ttl)
    elseif recorded > 0 then
      redis.call('EXPIRE', fence_key, ttl)
    end
  end
end
return out
"""

# KEYS: stream, fence key. ARGV: fence, the entry id of the last committed step ("0-0": none),
# ttl. Records the fence (unless a higher one is recorded: {-1, {}}), then returns {dropped,
# adopted}: adopted, the ``tokens`` entries of the steps right after the committed one, in step
# order and without a gap (each as XRANGE gives it); every entry after the first that breaks the
# run (a gap Redis left when it lost entries, or any other event) is deleted and the stream's last
# id set back to the last adopted step, so the run's next step is appended right after it.
_BEGIN_RUN_LUA = """
local recorded = tonumber(redis.call('GET', KEYS[2]) or '0')
local fence = tonumber(ARGV[1])
if fence < recorded then
  return {-1, {}}
end
redis.call('SET', KEYS[2], fence, 'EX', tonumber(ARGV[3]))
local entries = redis.call('XRANGE', KEYS[1], '(' .. ARGV[2], '+')
local expected = tonumber(string.match(ARGV[2], '^(%d+)')) + 1
local last = ARGV[2]
local adopted = {}
for _, entry in ipairs(entries) do
  local fields, event = entry[2], nil
  for j = 1, #fields, 2 do
    if fields[j] == 'event' then event = fields[j + 1] end
  end
  if event ~= 'tokens' or entry[1] ~= string.format('%d-0', expected) then
    break
  end
  adopted[#adopted + 1] = entry
  last = entry[1]
  expected = expected + 1
end
for k = #adopted + 1, #entries do
  redis.call('XDEL', KEYS[1], entries[k][1])
end
if #entries > #adopted then
  redis.call('XSETID', KEYS[1], last)
end
return {#entries - #adopted, adopted}
"""


def client() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
    return _client


def stream_key(session_id) -> str:
    return f"specops:stream:{session_id}"


def fence_key(session_id) -> str:
    return f"specops:stream:{session_id}:fence"


def _script(name: str, source: str):
    """A registered script of this process's client (EVALSHA, loaded again after a restart)."""
    script = _scripts.get(name)
    if script is None or script.registered_client is not client():
        script = _scripts[name] = client().register_script(source)
    return script


def step_entry_id(step: int) -> str:
    """The stream entry id of step `step` (0-based): "<step + 1>-0". A `done` event takes the id
    the next step would have had, so ids follow the generation, not the clock."""
    return f"{step + 1}-0"


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One event to append to a session's stream; with ``step``, under that step's entry id; with
    ``fence``, only while no later run of the session has begun (`begin_run`)."""

    session_id: Any
    event: str
    data: dict[str, Any]
    step: int | None = None
    fence: int | None = None


ADDED, DUPLICATE, STALE = 1, 0, -1


def publish(session_id, event: str, data: dict, *, step: int | None = None, fence: int | None = None) -> bool:
    """Append an event; with `step`, under that step's entry id, exactly once.

    Redis refuses an XADD whose id is not above the stream's last one, so a resumed run that
    publishes a step the stream already holds adds nothing (returns False); so does a run whose
    ``fence`` is stale. A ``done`` seals the stream.
    """
    return publish_many([StreamEvent(session_id, event, data, step, fence)])[0]


def publish_many(events: list[StreamEvent]) -> list[bool]:
    """Append several events, of any sessions, in one round trip; per event, whether it was added."""
    return [outcome == ADDED for outcome in publish_fenced(events)]


def publish_fenced(events: list[StreamEvent]) -> list[int]:
    """Append several events in one script call; per event ADDED, DUPLICATE or STALE.

    What a batch step streams: one EVALSHA for all its rows instead of one round trip per row
    (each event exactly once by its step's entry id, as in `publish`). A refused duplicate leaves
    the others added, and its stream's expiry is renewed all the same; a stale event (its run's
    fence is below the stream's) is not added and touches nothing.
    """
    if not events:
        return []
    keys: list[str] = []
    args: list[Any] = [STREAM_TTL_S, SEALED]
    for item in events:
        keys += [stream_key(item.session_id), fence_key(item.session_id)]
        args += ["" if item.fence is None else int(item.fence),
                 step_entry_id(item.step) if item.step is not None else "*",
                 item.event, json.dumps(item.data), "1" if item.event == "done" else "0"]
    return [int(outcome) for outcome in _script("publish", _PUBLISH_LUA)(keys=keys, args=args)]


@dataclass(frozen=True, slots=True)
class RunStart:
    """What a claimed run finds on its session's stream (`begin_run`).

    ``adopted``: the ``tokens`` entries of the steps after the committed one that earlier runs
    streamed (clients may have seen them), in step order; the run resumes after them.
    ``dropped``: entries past a gap, deleted. ``stale``: a later run has begun (nothing read).
    """

    stale: bool
    adopted: tuple[StreamEntry, ...] = ()
    dropped: int = 0


def begin_run(session_id, fence: int, step: int) -> RunStart:
    """A claimed run starts after committed step `step`: record its fence and read what earlier
    runs streamed past that step, atomically, so no older run appends in between or after.

    A step a client was streamed is never made again: the run adopts it (writes its rows, resumes
    after it). Only entries past a gap in the steps (Redis lost some) are deleted.
    """
    dropped, adopted = _script("begin_run", _BEGIN_RUN_LUA)(
        keys=[stream_key(session_id), fence_key(session_id)],
        args=[int(fence), step_entry_id(step), STREAM_TTL_S])
    if int(dropped) < 0:
        return RunStart(stale=True)
    entries = []
    for entry_id, flat in adopted:
        fields = dict(zip(flat[::2], flat[1::2]))
        entries.append(StreamEntry(entry_id.decode(), fields[b"event"].decode(), json.loads(fields[b"data"])))
    return RunStart(stale=False, adopted=tuple(entries), dropped=int(dropped))


_RAISE_FENCE_LUA = """
if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
end
return 1
"""


def raise_fence(session_id, fence: int) -> None:
    """Refuse from now on the events of runs below ``fence`` (a session handed back to its queue:
    its next claim will be ``fence``, and the lost run must not stream in the meantime)."""
    _script("raise_fence", _RAISE_FENCE_LUA)(keys=[fence_key(session_id)], args=[int(fence), STREAM_TTL_S])


# ---- async reading (the ASGI web server) ------------------------------------------------------

HEARTBEAT = "heartbeat"  # afollow: nothing new for heartbeat_s
IDLE_LIMIT = "idle_limit"  # afollow: nothing new for idle_limit_s; the last item

_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, redis.asyncio.Redis] = (
    weakref.WeakKeyDictionary())


def is_entry_id(value: str) -> bool:
    """A stream id Redis accepts (``stream_hub.is_entry_id``): a client's ``Last-Event-ID`` is checked with it."""
    return stream_hub.is_entry_id(value)


def async_client() -> redis.asyncio.Redis:
    """This event loop's client (redis.asyncio connections belong to the loop that made them).

    A small bounded pool (``SPECOPS_STREAM_REDIS_CONNECTIONS``), whatever the number of open
    streams: one connection blocks in the stream hub's read of them all (``stream_hub``), the
    others serve short commands; a command that finds them all busy waits for one.
    """
    loop = asyncio.get_running_loop()
    client_ = _async_clients.get(loop)
    if client_ is None:
        from core.conf import conf

        # The hub's read blocks up to BLOCK_MS server-side: the socket timeout is well above it.
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            settings.REDIS_URL, max_connections=max(2, conf.STREAM_REDIS_CONNECTIONS), timeout=30,
            socket_connect_timeout=5, socket_timeout=stream_hub.BLOCK_MS / 1000 + 25,
            client_name=stream_client_name())
        client_ = redis.asyncio.Redis(connection_pool=pool)
        _async_clients[loop] = client_
    return client_


def stream_client_name() -> str:
    """What ``CLIENT LIST`` names this process's stream connections: ``specops-streams-<pid>``."""
    return f"specops-streams-{os.getpid()}"


def _entries(batches) -> list[StreamEntry]:
    return [entry for _key, entries in batches or () for entry in stream_hub.decode_entries(entries)]


async def afollow(session_id, after: str = "0-0", *, heartbeat_s: float, idle_limit_s: float,
                  ended: Callable[[], Awaitable[dict | None]] | None = None,
                  ) -> AsyncIterator[StreamEntry | str]:
    """Yield the stream's entries after entry id ``after`` until ``done`` (the last item).

    ``HEARTBEAT`` comes after each ``heartbeat_s`` without an entry, ``IDLE_LIMIT`` (the last item)
    after ``idle_limit_s``. ``ended`` is asked when the stream is quiet (right away if the first
    read finds nothing, then at each heartbeat): it returns the ``done`` data of a session that
    has ended, which is yielded as a synthesized ``done`` once the stream is drained.

    The first read is this follower's own (it does not block); after it, the loop's stream hub
    reads for it, together with every other open stream of the process. Only an id Redis has
    taken joins the hub: an id it refuses fails this follower's own first read (``ValueError``
    for one that is not a stream id at all), never the shared read of every stream.
    """
    key = stream_key(session_id)
    client_ = async_client()
    loop = asyncio.get_running_loop()
    subscription: stream_hub.Subscription | None = None
    try:
        quiet_since, wait_s = loop.time(), None  # the first read does not block
        while True:
            if subscription is None:
                if not is_entry_id(after):
                    raise ValueError(f"{after!r} is not a stream id Redis accepts")
                first = _entries(await client_.xread({key: after}, count=100))
                subscription = stream_hub.hub_of(client_).subscribe(key, after)
                subscription.offer(first)
            else:
                await subscription.wait(wait_s)
            entries = subscription.take()
            for entry in entries:
                yield entry
                if entry.event == "done":
                    return
            if entries:
                quiet_since, wait_s = loop.time(), _block_ms(heartbeat_s, idle_limit_s, 0.0) / 1000
                continue
            final = await ended() if ended is not None else None
            if final is not None:
                # Whatever was published between the read and the check comes first.
                subscription.offer(_entries(await client_.xread({key: subscription.position}, count=10_000)))
                for entry in subscription.take():
                    yield entry
                    if entry.event == "done":
                        return
                yield StreamEntry("", "done", final)
                return
            quiet = loop.time() - quiet_since
            if quiet >= idle_limit_s:
                yield IDLE_LIMIT
                return
            if wait_s is not None:
                yield HEARTBEAT
            wait_s = _block_ms(heartbeat_s, idle_limit_s, quiet) / 1000
    finally:
        if subscription is not None:
            subscription.close()


def _block_ms(heartbeat_s: float, idle_limit_s: float, quiet_s: float) -> int:
    return max(1, int(min(heartbeat_s, idle_limit_s - quiet_s) * 1000))


def ended_event(session_id) -> dict | None:
    """The ``done`` data of a session that has finished, failed or been cancelled, else None (sync).

    Reads the session's state through the two-tier cache, and the row only once it has ended.
    """
    from metadata.models import LIVE_STATUSES, Session
    from sessions.state import get_session_state

    state = get_session_state(session_id)
    if state is None:
        return {"status": "failed", "finish_reason": "", "error": "the session no longer exists."}
    if state["status"] in LIVE_STATUSES:
        return None
    row = Session.objects.filter(pk=session_id).values("status", "finish_reason", "error").first()
    return row if row is not None and row["status"] not in LIVE_STATUSES else None
