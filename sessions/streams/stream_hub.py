"""One blocking read for every open stream of a web process: the stream hub.

A stream blocking in an ``XREAD`` of its own, on a Redis connection of its own, would bound a web
process's open streams by Redis's ``maxclients`` (shared by every process), and past it the
throttles, which count in Redis too, would fail open. Instead one reader task per event
loop (``StreamHub``) blocks in a single ``XREAD`` over every followed key, each key at the lowest
entry id its followers have reached, and hands each follower (a ``Subscription``) the entries
after its own position, in order, each once. A process then needs a few connections from a
bounded pool whatever the number of its streams: the hub's, and a few for short commands (a
follower's first read, the open-stream slots).

A follower that joins while the hub's read blocks wakes it with an ``XADD`` to the hub's own wake
key, which that read names at the id it last saw: a wake that reaches Redis before the read
still ends it at once, so a new stream never waits for the block to time out. One wake at most
per read: a thousand streams opening together cost one ``XADD``, not a thousand.

One follower's failure is its own: an id reaches the shared read only once Redis has taken it in
the follower's own first read (``token_stream.afollow``), ids are checked against what Redis
accepts before that (``is_entry_id``), and an error the shared read still meets that names one
key (a command error, not a lost connection) is traced to that key's followers, which alone end
with it; entries a follower cannot take end that follower only.

Why hand-written: redis-py has no multiplexing reader for streams (consumer groups would make
each stream's position server-side state that outlives the client, and every follower of a
session reads the same entries, which a group would share out instead).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

logger = logging.getLogger(__name__)

BLOCK_MS = 5_000  # the hub's read blocks this long at most (a wake or an entry ends it sooner)
COUNT = 100  # entries per key per read
RETRY_S = 0.5  # the pause after a failed read (its followers are told; Redis may be restarting)
WAKE_TTL_S = 60


class FollowerError(RedisError):
    """What ends one follower (and no other): Redis refused its read, or its entries could not be taken."""


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One event of a session's stream; ``id`` is its Redis entry id ("" for a synthesized ``done``)."""

    id: str
    event: str
    data: dict[str, Any]


# Redis stream ids are two unsigned 64-bit integers, "<ms>-<seq>"; XREAD refuses a larger part.
ENTRY_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
MAX_ID_PART = 2**64 - 1


def is_entry_id(value: str) -> bool:
    """Whether ``value`` is a stream id Redis accepts: ``<ms>-<seq>``, each part at most 2^64 - 1."""
    match = ENTRY_ID.fullmatch(value)
    return match is not None and int(match[1]) <= MAX_ID_PART and int(match[2]) <= MAX_ID_PART


def parse_entry_id(entry_id: str) -> tuple[int, int]:
    milliseconds, _, sequence = entry_id.partition("-")
    return int(milliseconds), int(sequence or 0)


def decode_entries(entries) -> list[StreamEntry]:
    """One key's entries of an ``XREAD`` reply as ``StreamEntry``; ``FollowerError`` for an entry
    not as a worker writes them (its followers end, with an error they can report)."""
    try:
        return [StreamEntry(entry_id.decode(), fields[b"event"].decode(), json.loads(fields[b"data"]))
                for entry_id, fields in entries]
    except (KeyError, ValueError, TypeError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise FollowerError(f"a stream entry cannot be read: {exc!r}") from None


class Subscription:
    """One follower's place in one stream: the entries it has been handed and not yet taken."""

    def __init__(self, hub: StreamHub, key: str, after: str) -> None:
        if not is_entry_id(after):
            raise ValueError(f"{after!r} is not a stream id Redis accepts (<ms>-<seq>, each at most {MAX_ID_PART})")
        self.hub, self.key = hub, key
        self.position = after  # the id of the last entry handed over (or the one to read after)
        self._position = parse_entry_id(after)
        self._buffer: list[StreamEntry] = []
        self._error: RedisError | None = None
        self._arrived = asyncio.Event()

    def offer(self, entries: list[StreamEntry]) -> None:
        """Keep the entries past this follower's position (the hub's read may start lower)."""
        for entry in entries:
            parsed = parse_entry_id(entry.id)
            if parsed > self._position:
                self._buffer.append(entry)
                self._position, self.position = parsed, entry.id
        if self._buffer:
            self._arrived.set()

    def fail(self, error: RedisError) -> None:
        self._error = error
        self._arrived.set()

    def take(self) -> list[StreamEntry]:
        """The entries handed over since the last take, in order; raises the hub's read error
        once they are all taken."""
        entries, self._buffer = self._buffer, []
        if not entries and self._error is not None:
            error, self._error = self._error, None
            raise error
        return entries

    async def wait(self, timeout_s: float) -> None:
        """Until an entry (or the hub's error) arrives, or ``timeout_s``."""
        if self._buffer or self._error is not None:
            return
        self._arrived.clear()
        try:
            async with asyncio.timeout(timeout_s):
                await self._arrived.wait()
        except TimeoutError:
            pass

    def close(self) -> None:
        self.hub.unsubscribe(self)


class StreamHub:
    """The reader of one event loop's streams (``subscribe``; ``Subscription.close`` when done)."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self.wake_key = f"specops:streamhub:{uuid.uuid4().hex}"
        self._wake_id = "0-0"
        self._followers: dict[str, list[Subscription]] = {}
        self._task: asyncio.Task | None = None
        self._reading: dict[str, str] | None = None  # the read in flight: key -> id
        self._woken = False  # a wake is on its way for the read in flight
        self._wakes: set[asyncio.Task] = set()

    @property
    def followed_keys(self) -> int:
        return len(self._followers)

    @property
    def running(self) -> bool:
        """Whether the reader task is alive (it ends once no follower is left)."""
        return self._task is not None

    @property
    def keys_in_flight(self) -> int:
        """How many followed keys the read in flight covers (0 when none is)."""
        return len(self._reading) - 1 if self._reading else 0

    def subscribe(self, key: str, after: str = "0-0") -> Subscription:
        """Follow ``key`` after entry id ``after`` (one Redis has taken: ``token_stream.afollow``
        reads it first on its own). Raises ValueError for an id Redis would refuse."""
        subscription = Subscription(self, key, after)
        self._followers.setdefault(key, []).append(subscription)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="specops-stream-hub")
        elif self._reading is not None and (
                key not in self._reading or parse_entry_id(self._reading[key]) > parse_entry_id(after)):
            self._end_read()  # the read in flight does not cover this follower: end it now
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        followers = self._followers.get(subscription.key, [])
        if subscription in followers:
            followers.remove(subscription)
        if not followers:
            self._followers.pop(subscription.key, None)
        if not self._followers and self._reading is not None:
            # Nothing left to read: end the read in flight now rather than let it block until
            # BLOCK_MS (a pending task holds a connection, and an event loop that closes meanwhile
            # would destroy it); the task then ends on its own, and the next subscribe starts a
            # new one. Not cancelled: redis-py (8.1) loses count of a pooled connection whose
            # command is cancelled at the wrong await, and the BlockingConnectionPool ran dry
            # after a few hundred streams had opened and closed one at a time ("No connection
            # available" after its 30 s wait, tests/metadata/test_stream_hub.py).
            self._end_read()

    def _end_read(self) -> None:
        """Make the read in flight return now (one wake per read)."""
        if self._woken:
            return
        self._woken = True
        task = asyncio.get_running_loop().create_task(self._wake())
        self._wakes.add(task)  # referenced until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._wakes.discard)

    async def _wake(self) -> None:
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                await pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1, approximate=False).expire(
                    self.wake_key, WAKE_TTL_S).execute()
        except RedisError as exc:  # the read ends at its block timeout instead
            logger.warning("stream hub: wake failed: %s", exc)

    async def _run(self) -> None:
        me = asyncio.current_task()
        try:
            while self._followers:
                try:
                    await self._read_once()
                except Exception as exc:  # never leave followers waiting on a reader that died
                    logger.exception("stream hub: read loop failed (%d streams)", len(self._followers))
                    self._fail_all(FollowerError(f"the stream reader failed: {exc}"))
                    await asyncio.sleep(RETRY_S)
        finally:
            if self._task is me:
                self._task = None

    async def _read_once(self) -> None:
        streams = {self.wake_key: self._wake_id}
        for key, followers in self._followers.items():
            streams[key] = min((f.position for f in followers), key=parse_entry_id)
        self._reading, self._woken = streams, False
        try:
            batches = await self.client.xread(streams, block=BLOCK_MS, count=COUNT)
        except ResponseError as exc:  # Redis refused the command: find whose part of it
            logger.warning("stream hub: read refused (%d streams): %s", len(streams) - 1, exc)
            if not await self._fail_refused(streams):
                self._fail_all(exc)
                await asyncio.sleep(RETRY_S)
            return
        except RedisError as exc:
            logger.warning("stream hub: read failed (%d streams): %s", len(streams) - 1, exc)
            self._fail_all(exc)
            await asyncio.sleep(RETRY_S)
            return
        finally:
            self._reading = None
        for raw_key, entries in batches or ():
            key = raw_key.decode()
            if key == self.wake_key:
                self._wake_id = entries[-1][0].decode()
                continue
            try:
                decoded = decode_entries(entries)
            except FollowerError as exc:
                self._fail_key(key, exc)
                continue
            for follower in list(self._followers.get(key, ())):
                follower.offer(decoded)

    async def _fail_refused(self, streams: dict[str, str]) -> bool:
        """After Redis refused the shared read: read each key alone (no block, one pipeline) and
        end the followers of the keys Redis refuses; whether any key was refused alone."""
        keys = [key for key in streams if key != self.wake_key]
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.xread({key: streams[key]}, count=1)
                results = await pipe.execute(raise_on_error=False)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            return False
        refused = [(key, result) for key, result in zip(keys, results) if isinstance(result, Exception)]
        for key, error in refused:
            self._fail_key(key, FollowerError(f"Redis refused the read of {key}: {error}"))
        return bool(refused)

    def _fail_key(self, key: str, error: RedisError) -> None:
        """End every follower of ``key`` with ``error``; the hub reads on for the others."""
        for follower in self._followers.pop(key, ()):
            follower.fail(error)

    def _fail_all(self, error: RedisError) -> None:
        for followers in self._followers.values():
            for follower in followers:
                follower.fail(error)


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StreamHub] = weakref.WeakKeyDictionary()


def hub_of(client: redis.asyncio.Redis) -> StreamHub:
    """This event loop's hub (reading with ``client``, a client of the same loop)."""
    loop = asyncio.get_running_loop()
    hub = _hubs.get(loop)
    if hub is None or hub.client is not client:
        hub = _hubs[loop] = StreamHub(client)
    return hub
