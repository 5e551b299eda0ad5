"""The stream hub: many open streams on one event loop read through a few Redis connections.

Real Redis: steps are published as the worker does (``publish(..., step=)``) and followed with
``token_stream.afollow``, which reads through the loop's ``StreamHub`` after its first read.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid

import redis
import redis.asyncio
from django.conf import settings

from core.conf import conf
from sessions.streams import stream_hub, token_stream

FOLLOWERS = 300
STEPS = 4


def streams_connections() -> int:
    """This process's stream connections to Redis (named ``specops-streams-<pid>``)."""
    return sum(1 for client in redis.Redis.from_url(settings.REDIS_URL).client_list()
               if client.get("name") == token_stream.stream_client_name())


class ConnectionPeak(threading.Thread):
    """The most stream-pool connections seen at once, sampled every 20 ms while in use."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.connections, self.stop = 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.connections = max(self.connections, streams_connections())

    def __enter__(self) -> ConnectionPeak:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join()


async def follow_all(session_id, after: str = "0-0") -> list[tuple[str, str, dict]]:
    items = []
    async for item in token_stream.afollow(session_id, after, heartbeat_s=30, idle_limit_s=60):
        items.append((item.id, item.event, item.data))
    return items


def publish_steps(session_ids, steps: range) -> None:
    token_stream.publish_many([token_stream.StreamEvent(session_id, "tokens", {"step": step}, step=step)
                               for step in steps for session_id in session_ids])


def test_many_streams_read_through_a_few_connections_each_entry_once_in_order():
    sessions = [uuid.uuid4() for _ in range(FOLLOWERS)]
    publish_steps(sessions[:10], range(1))  # some streams hold a step before they are followed

    async def scenario():
        tasks = [asyncio.create_task(follow_all(s)) for s in sessions]
        # a second follower of one session, resuming after its first step
        late = asyncio.create_task(follow_all(sessions[0], token_stream.step_entry_id(0)))
        hub = stream_hub.hub_of(token_stream.async_client())
        async with asyncio.timeout(20):  # every follower has made its first read and waits on the hub
            while hub.keys_in_flight < FOLLOWERS or streams_connections() == 0:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
        publish_steps(sessions[10:], range(1))
        for step in range(1, STEPS):
            await asyncio.sleep(0.05)
            publish_steps(sessions, range(step, step + 1))
        token_stream.publish_many([token_stream.StreamEvent(s, "done", {"status": "succeeded"}, step=STEPS)
                                   for s in sessions])
        async with asyncio.timeout(30):
            results = await asyncio.gather(*tasks)
            late_items = await late
        return results, late_items

    before = streams_connections()  # an earlier test's closed event loop may leave its pool's
    peak = ConnectionPeak()
    try:
        with peak:
            results, late_items = asyncio.run(scenario())
    finally:
        redis.Redis.from_url(settings.REDIS_URL).delete(*[token_stream.stream_key(s) for s in sessions],
                                                        *[token_stream.fence_key(s) for s in sessions])
    expected = [(token_stream.step_entry_id(step), "tokens", {"step": step}) for step in range(STEPS)]
    expected.append((token_stream.step_entry_id(STEPS), "done", {"status": "succeeded"}))
    for items in results:
        assert items == expected
    assert late_items == expected[1:]
    assert peak.connections >= 1
    assert peak.connections - before <= max(2, conf.STREAM_REDIS_CONNECTIONS) < FOLLOWERS


def test_a_stream_opened_while_the_hub_blocks_gets_its_first_entry_at_once():
    quiet, joining = uuid.uuid4(), uuid.uuid4()

    async def scenario() -> float:
        waiting = asyncio.create_task(follow_all(quiet))
        await asyncio.sleep(0.3)  # the hub now blocks (up to BLOCK_MS) on the quiet stream alone
        follower = asyncio.create_task(follow_all(joining))
        await asyncio.sleep(0.2)  # its first read found nothing; the hub's read covers it
        published = time.perf_counter()
        publish_steps([joining], range(1))
        token_stream.publish(joining, "done", {"status": "succeeded"}, step=1)
        async with asyncio.timeout(stream_hub.BLOCK_MS / 1000 / 2):
            items = await follower
        waited = time.perf_counter() - published
        token_stream.publish(quiet, "done", {"status": "succeeded"}, step=0)
        await waiting
        assert [event for _, event, _ in items] == ["tokens", "done"]
        return waited

    try:
        waited = asyncio.run(scenario())
    finally:
        redis.Redis.from_url(settings.REDIS_URL).delete(*[token_stream.stream_key(s) for s in (quiet, joining)],
                                                        *[token_stream.fence_key(s) for s in (quiet, joining)])
    assert waited < 0.5, f"the joining stream waited {waited:.2f} s for the hub's read to time out"


def test_streams_opened_and_closed_one_at_a_time_give_every_connection_back():
    """The hub's task ends when its last follower leaves; each time it must give its connection
    back to the pool. (Cancelling its read did not, now and then: redis-py lost count of the
    connection, and after a few hundred streams opened and closed one at a time the pool of 8 had
    none left for anyone.)"""
    size = 4

    async def scenario() -> None:
        pool = redis.asyncio.BlockingConnectionPool.from_url(settings.REDIS_URL, max_connections=size, timeout=2)
        client = redis.asyncio.Redis(connection_pool=pool)
        hub = stream_hub.hub_of(client)
        rng = random.Random(7)
        try:
            for number in range(200):
                subscription = hub.subscribe(f"specops:test:hub:{uuid.uuid4().hex}")
                await asyncio.sleep(rng.random() * 0.003)  # the read is on its way, or blocks
                await client.exists("specops:test:hub:absent")  # a short command, as a slot's renewal
                hub.unsubscribe(subscription)
                await asyncio.sleep(rng.random() * 0.002)
            async with asyncio.timeout(2):  # the hub's last read ends with its wake
                while hub.running:
                    await asyncio.sleep(0.01)
            # every connection is the pool's again: as many blocking commands at once all get one
            async with asyncio.timeout(5):
                await asyncio.gather(*(client.blpop([f"specops:test:hub:empty:{n}"], timeout=0.3)
                                       for n in range(size)))
        finally:
            await client.aclose()

    asyncio.run(scenario())
