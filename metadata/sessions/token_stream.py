"""Per-session token streams in Redis Streams: the worker appends, API clients follow.

A Redis Stream (not pub/sub) so a client that connects late replays from the start and never
misses a token; the key expires an hour after the last write.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

import redis
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


def publish(session_id, event: str, data: dict) -> None:
    key = stream_key(session_id)
    pipe = client().pipeline()
    pipe.xadd(key, {"event": event, "data": json.dumps(data)})
    pipe.expire(key, STREAM_TTL_S)
    pipe.execute()


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
