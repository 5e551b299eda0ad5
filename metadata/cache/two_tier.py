"""Two-tier metadata cache: an in-process TTL LRU in front of Redis, with single-flight loads.

A speculative step makes dozens of identical reads of one session at once. A Redis round trip
costs about as much as a good SQL lookup, so what makes the burst cheap is the in-process tier
(~1 us a hit) and coalescing: N concurrent misses of one key cause one load per process (a
per-key flight) and, through a short Redis lock, one database read across processes.

Freshness rules (DESIGN.md, "Facts the code must respect"):

* Every value carries ``source_lsn`` (``metadata.cache.redis_tier.Versioned``). A caller whose floor
  (``metadata.replicas.lsn``) is above it skips the entry, so nobody is served a value older than their
  own write, whichever process or tier holds it.
* A load routes to a replica only if it has replayed both the caller's floor and the key's
  invalidation floor, so a replica behind the write is never read for the cache, and a value
  loaded before the write can never be stored after the invalidation (Lua check in Redis, a
  local floor map in process).
* Invalidation runs after commit (``metadata.cache.invalidation``); reads inside ``atomic()``
  bypass the cache (they may see the caller's uncommitted rows).
* Redis down: lookups fall through to the database, no error; the cache resumes when Redis
  answers again and invalidations that failed meanwhile are replayed.

Hot keys never make the burst wait twice: an entry past its local TTL is refreshed in the
background while readers keep using it (``metadata.cache.local_tier``), and for write-through data a
broadcast invalidation swaps the new value in from Redis instead of evicting it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from django.db import DatabaseError, connections

from metadata.cache.counters import (
    COALESCED,
    HITS,
    LOCAL,
    MISSES,
    REDIS,
    CacheStats,
    maybe_flush_to_redis,
)
from metadata.cache.invalidation import InvalidationBus, after_commit, after_commit_many, bus_for
from metadata.cache.local_tier import LocalTier
from metadata.cache.redis_tier import (
    UNAVAILABLE,
    PLAIN_VALUES,
    RedisGuard,
    RedisTier,
    ValueCodec,
    Versioned,
    default_guard,
)
from metadata.conf import conf
from metadata.replicas import lsn

logger = logging.getLogger(__name__)

# (ident, min_lsn) -> the value read from a database that has replayed min_lsn, and its position.
Loader = Callable[[str, int], Versioned]
# (idents, min_lsn) -> the same for several idents at once, in one read (missing rows: left out)
BatchLoader = Callable[[list[str], int], dict[str, Versioned]]


class WritePolicy(StrEnum):
    CACHE_ASIDE = "cache_aside"  # a write deletes the entry; the next read loads it
    WRITE_THROUGH = "write_through"  # a write reloads the entry from the primary at once


@dataclass(frozen=True)
class CacheConfig:
    local_ttl_s: float = 1.0  # then refreshed ahead by one reader, dropped after twice this
    local_maxsize: int = 10_000
    redis_ttl_s: float = 45.0
    lock_ttl_s: float = 2.0
    peer_wait_s: float = 0.2  # how long a process waits for another process's load
    flight_wait_s: float = 2.0  # how long a thread waits for another thread's load

    @classmethod
    def from_settings(cls) -> CacheConfig:
        return cls(
            local_ttl_s=conf.CACHE_LOCAL_TTL_S,
            local_maxsize=conf.CACHE_LOCAL_MAXSIZE,
            redis_ttl_s=conf.CACHE_REDIS_TTL_S,
            lock_ttl_s=conf.CACHE_LOCK_TTL_S,
        )


class _Flight:
    """One in-process load that concurrent readers of the same key wait for."""

    __slots__ = ("done", "result")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Versioned | None = None


class TwoTierCache:
    """One kind of cached data (``name``), loaded by ``loader``, kept under ``policy``."""

    def __init__(
        self, name: str, loader: Loader, policy: WritePolicy = WritePolicy.CACHE_ASIDE, *,
        local: bool = True, redis: bool = True, coalesce: bool = True, guard: RedisGuard | None = None,
        config: CacheConfig | None = None, batch_loader: BatchLoader | None = None,
        values: ValueCodec = PLAIN_VALUES,
    ) -> None:
        self.name = name
        self.loader = loader
        self.batch_loader = batch_loader  # the write-through reload of several idents (invalidate_many)
        self.policy = policy
        self.config = config or CacheConfig.from_settings()
        self.local_enabled = local
        self.redis_enabled = redis
        self.coalesce = coalesce  # in-process single-flight (off only for the benchmark's baseline)
        self.guard = guard or default_guard()
        # ``values``: how values that are not plain data become rows in Redis (redis_tier.ValueCodec)
        self.redis = RedisTier(self.guard, self.config.redis_ttl_s, self.config.lock_ttl_s, values)
        self.bus: InvalidationBus = bus_for(self.guard)
        self.bus.register(self)
        self.stats = CacheStats(name)
        self.loads = 0  # database loads made by this process (the benchmark reads it)
        self._lock = threading.Lock()  # guards the flights and the unsent invalidations
        self._local = LocalTier(self.config.local_maxsize, self.config.local_ttl_s)
        self._flights: dict[str, _Flight] = {}
        self._refresher_pool: ThreadPoolExecutor | None = None
        self._refresher_pid = 0
        self._unsent: dict[str, int] = {}  # invalidations Redis missed: key -> position
        self.guard.on_recover(self._replay_unsent_invalidations)

    def close(self) -> None:
        """Stop receiving broadcasts (a variant built by a test or the benchmark)."""
        self.bus.unregister(self)

    def key(self, ident: str) -> str:
        return f"specops:c:{self.name}:{ident}"

    # ------------------------------------------------------------------ reads
    def get(self, ident: str) -> Any:
        """The value of ``ident`` (None if there is no such row), fresh for this caller."""
        if connections[lsn.PRIMARY_ALIAS].in_atomic_block:
            return self._load(ident, lsn.NO_LSN).value  # may see uncommitted rows: never cached
        if self.local_enabled:
            self.bus.ensure_listening()
        maybe_flush_to_redis(self.guard)
        floor = lsn.required_lsn()
        key = self.key(ident)
        if self.local_enabled:
            found = self._local.get(key)
            if found is not None and found[0].fresh_for(floor):
                entry, due = found
                if due and self._local.claim_refresh(key):
                    self._refresh_in_background(key, ident)
                self.stats.record(LOCAL, HITS)
                lsn.note_served_by("cache:local")
                return entry.value
            self.stats.record(LOCAL, MISSES)
        return self._get_coalesced(key, ident, floor).value

    def _refresh_in_background(self, key: str, ident: str) -> None:
        """Reload a due entry off the read path (refresh ahead, see metadata.cache.local_tier)."""
        def refresh() -> None:
            try:
                with lsn.floor_scope():
                    self._get_coalesced(key, ident, lsn.NO_LSN)
            except Exception:  # the entry just ages out; the next reader loads it
                logger.warning("refresh of %s failed", key, exc_info=True)
            finally:
                self._local.end_refresh(key)
                connections.close_all()  # give the pooled connection back (not a request thread)

        try:
            self._refresher().submit(refresh)
        except RuntimeError:  # interpreter shutting down
            self._local.end_refresh(key)

    def _refresher(self) -> ThreadPoolExecutor:
        if self._refresher_pid != os.getpid():  # none yet, or inherited through a fork
            self._refresher_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"specops-{self.name}")
            self._refresher_pid = os.getpid()
        return self._refresher_pool

    def _get_coalesced(self, key: str, ident: str, floor: int) -> Versioned:
        if not self.coalesce:
            return self._fetch(key, ident, floor)
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
        if not leader:
            if flight.done.wait(self.config.flight_wait_s) and flight.result is not None \
                    and flight.result.fresh_for(floor):
                self.stats.record(LOCAL, COALESCED)
                return flight.result
            return self._fetch(key, ident, floor)  # the leader failed, or read too early for us
        try:
            flight.result = self._fetch(key, ident, floor)
            return flight.result
        finally:
            with self._lock:
                if self._flights.get(key) is flight:
                    del self._flights[key]
            flight.done.set()

    def _fetch(self, key: str, ident: str, floor: int) -> Versioned:
        if self.redis_enabled:
            found = self.redis.get(key)
            if found is not UNAVAILABLE:
                entry, key_floor = found
                if entry is not None and entry.fresh_for(floor):
                    self.stats.record(REDIS, HITS)
                    lsn.note_served_by("cache:redis")
                    self._put_local(key, entry)
                    return entry
                self.stats.record(REDIS, MISSES)
                return self._load_once_across_processes(key, ident, max(floor, key_floor))
        loaded = self._load(ident, floor)  # Redis off or down: the database, coalesced in process
        self._put_local(key, loaded)
        return loaded

    def _load_once_across_processes(self, key: str, ident: str, min_lsn: int) -> Versioned:
        lock = self.redis.try_lock(key)
        if lock is None:  # another process is loading this key: wait briefly for its result
            entry = self._wait_for_peer(key, min_lsn)
            if entry is not None:
                self.stats.record(REDIS, COALESCED)
                self._put_local(key, entry)
                return entry
        try:
            loaded = self._load(ident, min_lsn)
            if loaded.value is not None and self.redis_enabled:
                self.redis.store_if_fresh(key, loaded)
        finally:
            if lock is not None and lock is not UNAVAILABLE:
                self.redis.release(lock)
        self._put_local(key, loaded)
        return loaded

    def _wait_for_peer(self, key: str, min_lsn: int) -> Versioned | None:
        deadline = time.monotonic() + self.config.peer_wait_s
        pause = 0.001
        while time.monotonic() < deadline:
            time.sleep(pause)
            found = self.redis.get(key)
            if found is UNAVAILABLE:
                return None
            entry, _ = found
            if entry is not None and entry.fresh_for(min_lsn):
                return entry
            pause = min(pause * 2, 0.02)
        return None

    def _load(self, ident: str, min_lsn: int) -> Versioned:
        with self._lock:
            self.loads += 1
        return self.loader(ident, min_lsn)

    def _put_local(self, key: str, entry: Versioned) -> None:
        if self.local_enabled and entry.value is not None:
            self._local.put(key, entry)

    # ------------------------------------------------------------------ writes
    def invalidate(self, ident: str) -> None:
        """Invalidate (cache-aside) or refresh (write-through) ``ident`` after the commit."""
        after_commit(self, ident)

    def apply_invalidation(self, ident: str, position: int) -> None:
        """Run after commit with a floor read after it: Redis first, then every local tier."""
        key = self.key(ident)
        self.evict_local(key, position)
        fresh = None
        if self.policy is WritePolicy.WRITE_THROUGH and position != lsn.NO_LSN:
            try:
                with lsn.primary_only():
                    fresh = self._load(ident, position)
            except DatabaseError:
                logger.warning("write-through reload of %s failed; invalidating instead", key, exc_info=True)
        if fresh is not None and fresh.value is not None:
            result = self.redis.write_through(key, fresh, position)
        else:
            fresh, result = None, self.redis.invalidate(key, position)
        self._settled([(key, fresh)], result, position)

    def invalidate_many(self, idents: list[str]) -> None:
        """``invalidate`` of several idents, applied together after the commit (`apply_invalidations`)."""
        after_commit_many(self, idents)

    def apply_invalidations(self, idents: list[str], position: int) -> None:
        """`apply_invalidation` of several idents: the write-through's reload in one read (with a
        ``batch_loader``), every Redis update in one pipeline, one broadcast."""
        keys = {ident: self.key(ident) for ident in dict.fromkeys(idents)}
        for key in keys.values():
            self.evict_local(key, position)
        fresh: dict[str, Versioned] = {}
        if self.policy is WritePolicy.WRITE_THROUGH and position != lsn.NO_LSN:
            try:
                with lsn.primary_only():
                    fresh = self._load_many(list(keys), position)
            except DatabaseError:
                logger.warning("write-through reload of %d keys of %s failed; invalidating instead",
                               len(keys), self.name, exc_info=True)
        entries = [(key, fresh.get(ident)) for ident, key in keys.items()]
        entries = [(key, entry if entry is not None and entry.value is not None else None) for key, entry in entries]
        self._settled(entries, self.redis.settle_many(entries, position), position)

    def _settled(self, entries: list[tuple[str, Versioned | None]], result: object, position: int) -> None:
        """After Redis took (or missed) the keys' new values or invalidations: the values written
        through go in here too, invalidations Redis missed wait for its return, and every other
        process hears of the keys."""
        for key, entry in entries:
            if entry is not None:
                self._put_local(key, entry)
        if result is UNAVAILABLE:
            with self._lock:
                for key, _ in entries:
                    self._unsent[key] = max(position, self._unsent.get(key, 0))
        self.bus.publish(self.name, [key for key, _ in entries], position)

    def _load_many(self, idents: list[str], min_lsn: int) -> dict[str, Versioned]:
        if self.batch_loader is None:
            return {ident: self._load(ident, min_lsn) for ident in idents}
        with self._lock:
            self.loads += 1
        return self.batch_loader(idents, min_lsn)

    def evict_local(self, key: str, position: int) -> None:
        self._local.evict(key, position)

    def on_broadcast(self, key: str, position: int) -> None:
        """Another process changed ``key`` (bus listener thread).

        Write-through: the new value is in Redis already, so a key held here is replaced in the
        background instead of evicted, and the burst's readers never wait for it. Otherwise, or if
        Redis has nothing as new as ``position``, evict.
        """
        if self.policy is WritePolicy.WRITE_THROUGH and self.redis_enabled and key in self._local:
            found = self.redis.get(key)
            if found is not UNAVAILABLE and found[0] is not None and self._local.replace(key, found[0], position):
                return
        self._local.evict(key, position)

    def clear_local(self) -> None:
        self._local.clear()

    def _replay_unsent_invalidations(self) -> None:
        with self._lock:
            unsent, self._unsent = self._unsent, {}
        for key, position in unsent.items():
            if self.redis.invalidate(key, position) is UNAVAILABLE:
                with self._lock:
                    self._unsent[key] = max(position, self._unsent.get(key, 0))
            else:
                self.bus.publish(self.name, [key], position)
