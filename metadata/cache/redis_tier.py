"""The shared cache tier: Redis through django-redis, skipped while Redis is unreachable.

Every entry is stored with the WAL position its value is known to reflect (``source_lsn``), and
every key has an invalidation floor ``<key>:inv``: the position read after the last write that
changed it committed. Three small Lua scripts keep the two consistent atomically:

* a miss is stored only if its ``source_lsn`` >= the key's floor, so a value read before the
  write (from a lagging replica, or by a slow reader that started before the commit) can never
  be put back after the invalidation;
* an invalidation raises the floor and deletes the value in one step;
* a write-through raises the floor and stores the fresh value, unless a newer write already did.

Hand-written rather than a library: no Redis client offers a conditional set against a second
key. Positions travel as 16-digit hex strings, which Lua compares correctly as strings (Lua
numbers are doubles and lose precision above 2**53).

Values are stored as typed, versioned JSON (``metadata.cache.codec``), never pickled: a payload
the codec cannot read (an older format, a value planted by whoever can write to Redis) is a
miss. A cache whose values are not plain data (model instances) gives a ``ValueCodec`` that turns
them into rows and back.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from django.conf import settings

from metadata.cache import codec
from metadata.conf import conf

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Versioned:
    """A value and a position it reflects: it includes every write whose floor <= ``source_lsn``.

    ``value`` None means "no such row": returned to callers, never cached.
    """

    value: Any
    source_lsn: int

    def fresh_for(self, floor: int) -> bool:
        return floor <= self.source_lsn


@dataclass(frozen=True, slots=True)
class ValueCodec:
    """How one cache's values become plain data for ``metadata.cache.codec`` and come back:
    ``dump(value)`` before a store, ``load(plain)`` after a read (a failure there is a miss)."""

    dump: Callable[[Any], Any]
    load: Callable[[Any], Any]


PLAIN_VALUES = ValueCodec(dump=lambda value: value, load=lambda plain: plain)


class _Unavailable:
    def __repr__(self) -> str:
        return "UNAVAILABLE"


UNAVAILABLE = _Unavailable()  # what RedisGuard.run returns while Redis cannot be reached


class RedisGuard:
    """A Redis client that callers skip for ``retry_s`` after an error.

    Without it, every read during an outage would pay a connect timeout; with it, reads go
    straight to the database and the first call after ``retry_s`` finds out whether Redis is
    back. A dozen lines, so hand-written instead of adding a circuit-breaker dependency.
    """

    def __init__(self, client_factory: Callable[[], redis.Redis], retry_s: float = 0.5) -> None:
        self._client_factory = client_factory
        self._client: redis.Redis | None = None
        self.retry_s = retry_s
        self._retry_at = 0.0
        self._failed = False
        self._recover_callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    @property
    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = self._client_factory()  # redis-py's pool reconnects after a fork itself
        return self._client

    def available(self) -> bool:
        return time.monotonic() >= self._retry_at

    def on_recover(self, callback: Callable[[], None]) -> None:
        self._recover_callbacks.append(callback)

    def run(self, operation: Callable[[redis.Redis], T]) -> T | _Unavailable:
        if not self.available():
            return UNAVAILABLE
        try:
            result = operation(self.client)
        except (redis.RedisError, OSError) as exc:
            with self._lock:
                self._retry_at = time.monotonic() + self.retry_s
                if not self._failed:
                    logger.warning("redis unavailable, reading from the database: %s", exc)
                self._failed = True
            return UNAVAILABLE
        if self._failed:
            with self._lock:
                recovered, self._failed = self._failed, False
            if recovered:
                logger.warning("redis is back, cache resumed")
                for callback in list(self._recover_callbacks):
                    callback()
        return result


_STORE_IF_FRESH = """
local floor = redis.call('GET', KEYS[2])
if floor and ARGV[2] < floor then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""
_INVALIDATE = """
local floor = redis.call('GET', KEYS[2])
if (not floor) or ARGV[1] > floor then floor = ARGV[1] end
redis.call('SET', KEYS[2], floor, 'PX', ARGV[2])
redis.call('DEL', KEYS[1])
return 1
"""
_WRITE_THROUGH = """
local floor = redis.call('GET', KEYS[2])
if floor and ARGV[2] < floor then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[4])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""


def _hex(position: int) -> str:
    return f"{position:016x}"


class RedisTier:
    """Versioned entries, invalidation floors and short locks for one cache's keys."""

    def __init__(self, guard: RedisGuard, ttl_s: float, lock_ttl_s: float,
                 values: ValueCodec = PLAIN_VALUES) -> None:
        self.guard = guard
        self.values = values
        self.ttl_ms = int(ttl_s * 1000)
        self.floor_ttl_ms = 2 * self.ttl_ms  # outlives any reader that started before the write
        self.lock_ttl_s = lock_ttl_s
        self._scripts: dict[int, tuple[Any, Any, Any]] = {}

    def _script(self, client: redis.Redis, index: int):
        scripts = self._scripts.get(id(client))
        if scripts is None:  # register_script binds to a client; redis-py reloads it after a restart
            scripts = tuple(client.register_script(s) for s in (_STORE_IF_FRESH, _INVALIDATE, _WRITE_THROUGH))
            self._scripts[id(client)] = scripts
        return scripts[index]

    def get(self, key: str) -> tuple[Versioned | None, int] | _Unavailable:
        """(entry or None, the key's invalidation floor); an entry the codec cannot read is None."""
        result = self.guard.run(lambda client: client.mget(key, f"{key}:inv"))
        if result is UNAVAILABLE:
            return UNAVAILABLE
        payload, floor = result
        try:
            floor = int(floor, 16) if floor is not None else 0
        except (TypeError, ValueError):
            logger.warning("cache key %s has an unreadable floor; read as a miss", key)
            return None, 0
        return (self._entry(key, payload) if payload is not None else None), floor

    def _entry(self, key: str, payload: bytes) -> Versioned | None:
        try:
            value, source_lsn = codec.loads(payload)
            return Versioned(self.values.load(value), source_lsn)
        except (codec.UnreadableEntry, KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            logger.warning("cache entry %s is unreadable (%s); read as a miss", key, exc)
            return None

    def _payload(self, key: str, entry: Versioned) -> bytes | None:
        """The entry as the codec writes it, or None (logged) when its value has no encoder."""
        try:
            return codec.dumps(self.values.dump(entry.value), entry.source_lsn)
        except codec.UncacheableValue:
            logger.exception("cache entry %s not stored", key)
            return None

    def store_if_fresh(self, key: str, entry: Versioned) -> bool | _Unavailable:
        payload = self._payload(key, entry)
        if payload is None:
            return False
        return self.guard.run(lambda client: bool(self._script(client, 0)(
            keys=[key, f"{key}:inv"], args=[payload, _hex(entry.source_lsn), self.ttl_ms], client=client)))

    def invalidate(self, key: str, position: int) -> bool | _Unavailable:
        return self.guard.run(lambda client: bool(self._script(client, 1)(
            keys=[key, f"{key}:inv"], args=[_hex(position), self.floor_ttl_ms], client=client)))

    def write_through(self, key: str, entry: Versioned, position: int) -> bool | _Unavailable:
        payload = self._payload(key, entry)
        if payload is None:
            return self.invalidate(key, position)
        return self.guard.run(lambda client: bool(self._script(client, 2)(
            keys=[key, f"{key}:inv"], args=[payload, _hex(position), self.ttl_ms, self.floor_ttl_ms],
            client=client)))

    def settle_many(self, entries: list[tuple[str, Versioned | None]], position: int) -> list | _Unavailable:
        """For each (key, entry): `write_through` the entry, or `invalidate` the key when None; in
        one pipeline (the scripts run as in one call each, one round trip for all of them)."""
        payloads = [(key, None if entry is None else self._payload(key, entry)) for key, entry in entries]

        def run(client: redis.Redis) -> list:
            pipeline = client.pipeline(transaction=False)
            for key, payload in payloads:
                if payload is None:
                    self._script(client, 1)(keys=[key, f"{key}:inv"], args=[_hex(position), self.floor_ttl_ms],
                                            client=pipeline)
                else:
                    self._script(client, 2)(keys=[key, f"{key}:inv"],
                                            args=[payload, _hex(position), self.ttl_ms, self.floor_ttl_ms],
                                            client=pipeline)
            return [bool(done) for done in pipeline.execute()]

        return self.guard.run(run)

    def try_lock(self, key: str):
        """The short cross-process lock of one key's load (redis-py's Lock), None if a peer holds
        it, UNAVAILABLE if Redis is down."""
        def acquire(client: redis.Redis):
            lock = client.lock(f"{key}:lock", timeout=self.lock_ttl_s, blocking=False, thread_local=False)
            return lock if lock.acquire(blocking=False) else None

        return self.guard.run(acquire)

    def release(self, lock) -> None:
        def release(client: redis.Redis) -> None:
            try:
                lock.release()
            except redis.exceptions.LockError:
                pass  # expired while we loaded: a peer may have taken it, nothing to undo

        self.guard.run(release)


_default_guard: RedisGuard | None = None


def default_guard() -> RedisGuard:
    """The guard of the django-redis cache ``read_path`` (settings.CACHES; no client retries)."""
    global _default_guard
    if _default_guard is None:
        from django_redis import get_redis_connection

        alias = "read_path" if "read_path" in settings.CACHES else "default"
        _default_guard = RedisGuard(
            lambda: get_redis_connection(alias), retry_s=conf.CACHE_REDIS_RETRY_S
        )
    return _default_guard


def fail_fast_client(url: str, timeout_s: float = 0.25) -> redis.Redis:
    """A client that neither retries nor waits long: what RedisGuard expects underneath."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0))
