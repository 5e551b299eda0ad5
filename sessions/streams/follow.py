"""A session's events for a web reader: its committed steps, then the live ones, then its end.

The one follow of a session's stream, for every async view that reads one (the sessions API's
``/sessions/{id}/stream/`` and the OpenAI protocol's replies): ``sessions.streams.replay``
joins the token table and the Redis stream, and a session that ended without a ``done`` (its
worker died, it was cancelled) gets one made from its row. The database reads run off the event
loop and give their connection back at once (``run_db``): a stream may stay open for minutes.

A tenant's open session streams are bounded (``StreamSlot``): each holds a slot in a Redis sorted
set of the tenant's, scored by when it lapses, renewed at each heartbeat and removed when the
stream ends; a web process that dies leaves slots that lapse within a few heartbeats.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from core.conf import conf
from metadata.api.async_views import run_db
from sessions.streams import replay, token_stream

logger = logging.getLogger(__name__)

# Take a slot when fewer than the limit are live (lapsed ones dropped first), atomically.
_TAKE_SLOT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local open = redis.call('ZCARD', KEYS[1])
if open >= tonumber(ARGV[4]) then return open end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return -1
"""


def slot_ttl_s() -> float:
    """How long a slot outlives its last renewal: three heartbeats (a stream renews at each)."""
    return 3 * conf.STREAM_HEARTBEAT_S + 5


class StreamLimitReached(Exception):
    """The tenant already holds ``limit`` open streams."""

    def __init__(self, tenant, open_streams: int, limit: int) -> None:
        source = "the tenant's own max_open_streams" if tenant.max_open_streams is not None \
            else "SPECOPS_TENANT_MAX_OPEN_STREAMS"
        super().__init__(f"tenant '{tenant.name}' has {open_streams} session streams open, its limit "
                         f"(max_open_streams={limit}, {source}); close one or retry later.")
        self.open_streams, self.limit = open_streams, limit


class StreamSlot:
    """One open stream's place in its tenant's count (``take`` it before the response starts)."""

    def __init__(self, key: str, member: str) -> None:
        self.key, self.member = key, member
        self.renewed = time.monotonic()

    @staticmethod
    def key_of(tenant_id) -> str:
        return f"specops:streams:{tenant_id}"

    @classmethod
    def take(cls, tenant) -> StreamSlot | None:
        """A slot for one more stream of ``tenant`` (sync: the view's checks run in a thread);
        None when it has no limit or Redis is down (the stream then fails on its own reads).
        Raises ``StreamLimitReached``."""
        limit = tenant.open_stream_limit()
        if not limit:
            return None
        slot = cls(cls.key_of(tenant.pk), uuid.uuid4().hex)
        now, ttl = time.time(), slot_ttl_s()
        try:
            open_streams = token_stream.client().eval(
                _TAKE_SLOT, 1, slot.key, now, now + ttl, slot.member, limit, int(ttl) + 1)
        except RedisError as exc:
            logger.warning("open-stream count of tenant %s unavailable: %s", tenant.pk, exc)
            return None
        if open_streams >= 0:
            raise StreamLimitReached(tenant, open_streams, limit)
        return slot

    async def renew(self) -> None:
        ttl = slot_ttl_s()
        client = token_stream.async_client()
        await client.zadd(self.key, {self.member: time.time() + ttl}, xx=True)
        await client.expire(self.key, int(ttl) + 1)
        self.renewed = time.monotonic()

    async def release(self) -> None:
        await token_stream.async_client().zrem(self.key, self.member)


def follow(session_id, after: str = "0-0", *, idle_limit_s: float, slot: StreamSlot | None = None,
           history_first: bool = True) -> AsyncIterator[token_stream.StreamEntry | str]:
    """Yield the session's events after entry id ``after``, each step once and in order.

    Items are ``StreamEntry`` (``tokens`` per step, ``done`` last), ``token_stream.HEARTBEAT``
    after each ``SPECOPS_STREAM_HEARTBEAT_S`` without one, and ``token_stream.IDLE_LIMIT`` (the
    last item) after ``idle_limit_s``. With a ``slot``, it is renewed while the stream is open
    and released when it ends (close the iterator: ``contextlib.aclosing``).
    ``history_first=False``: the session has made no token yet, its table is not read first
    (``replay.areplay``).
    """
    items = replay.areplay(
        session_id, after, heartbeat_s=conf.STREAM_HEARTBEAT_S, idle_limit_s=idle_limit_s,
        committed=lambda step: run_db(replay.committed_steps, session_id, step),
        ended=lambda: run_db(token_stream.ended_event, session_id), history_first=history_first)
    return items if slot is None else _holding(items, slot)


async def _holding(items: AsyncIterator, slot: StreamSlot) -> AsyncIterator:
    try:
        async for item in items:
            if time.monotonic() - slot.renewed >= conf.STREAM_HEARTBEAT_S:
                await slot.renew()
            yield item
    finally:
        await items.aclose()
        try:
            await slot.release()
        except RedisError:
            pass  # the slot lapses on its own within slot_ttl_s()
