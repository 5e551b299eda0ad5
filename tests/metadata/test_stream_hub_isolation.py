"""The stream hub survives what one follower brings: each failure ends that follower only.

Real Redis, one event loop: a healthy follower of one session keeps receiving its steps while
other followers bring an id Redis refuses, a key that is not a stream, or an entry no worker
wrote; each of those ends with its own error, and the shared read goes on.
"""
from __future__ import annotations

import asyncio
import uuid

import pytest
import redis

from sessions.streams import stream_hub, token_stream

REDIS_REFUSES = "99999999999999999999-0"


def test_stream_ids_are_checked_against_what_redis_accepts():
    assert token_stream.is_entry_id("0-0") and token_stream.is_entry_id("18446744073709551615-18446744073709551615")
    for refused in (REDIS_REFUSES, "18446744073709551616-0", "0-18446744073709551616", "1", "-1-0", "1-0 ", "a-b"):
        assert not token_stream.is_entry_id(refused), refused
    with pytest.raises(ValueError):
        stream_hub.Subscription(None, "specops:stream:x", REDIS_REFUSES)


async def follow(session_id, after: str = "0-0") -> list:
    """The follower's events, or the error it ended with as its last item."""
    items = []
    try:
        async for item in token_stream.afollow(session_id, after, heartbeat_s=30, idle_limit_s=20):
            items.append(item.event)
    except (redis.RedisError, ValueError) as exc:
        items.append(exc)
    return items


def publish(session_id, step: int, event: str = "tokens") -> None:
    token_stream.publish(session_id, event, {"step": step}, step=step)


async def until_in_hub(*keys: str) -> None:
    hub = stream_hub.hub_of(token_stream.async_client())
    async with asyncio.timeout(10):
        while not all(key in hub._followers for key in keys) or hub.keys_in_flight < len(keys):
            await asyncio.sleep(0.02)


def test_one_followers_refused_id_wrong_key_or_unreadable_entry_ends_that_follower_only():
    healthy, corrupt, not_a_stream = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    publish(healthy, 0)
    publish(corrupt, 0)
    client = token_stream.client()

    async def scenario():
        survivor = asyncio.create_task(follow(healthy))
        broken = asyncio.create_task(follow(corrupt))
        await until_in_hub(token_stream.stream_key(healthy), token_stream.stream_key(corrupt))
        # thirty followers with an id Redis refuses: each refused before it reads
        refused = await asyncio.gather(*(follow(uuid.uuid4(), REDIS_REFUSES) for _ in range(30)))
        # a key that is not a stream: its follower's own first read fails, and it never joins the hub
        client.set(token_stream.stream_key(not_a_stream), "x", ex=60)
        own_read = await follow(not_a_stream)
        # the same key joined to the shared read: Redis refuses the whole XREAD, which ends its follower only
        hub = stream_hub.hub_of(token_stream.async_client())
        wrong = hub.subscribe(token_stream.stream_key(not_a_stream), "0-0")
        await wrong.wait(5)
        with pytest.raises(redis.RedisError):
            wrong.take()
        wrong.close()
        # an entry no worker wrote (no data field): its followers end, no one else's
        client.xadd(token_stream.stream_key(corrupt), {"event": "tokens"}, id="5-0")
        publish(healthy, 1)
        publish(healthy, 2, "done")
        async with asyncio.timeout(15):
            survived, ended = await survivor, await broken
            # a follower that meets the unreadable entry in its own first read ends with the same error
            return refused, own_read, survived, ended, await follow(corrupt)

    refused, own_read, survivor, broken, late = asyncio.run(scenario())
    assert all(len(items) == 1 and isinstance(items[0], ValueError) for items in refused), refused[0]
    assert len(own_read) == 1 and isinstance(own_read[0], redis.ResponseError)
    assert survivor == ["tokens", "tokens", "done"]
    assert broken[0] == "tokens" and isinstance(broken[-1], stream_hub.FollowerError)
    assert len(late) == 1 and isinstance(late[0], stream_hub.FollowerError)
