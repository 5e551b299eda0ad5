"""Invalidation after commit, and its broadcast to every process's local tier.

``after_commit`` defers an invalidation with ``transaction.on_commit``: before the commit, a
reader could load the old row again and cache it after the invalidation. The first hook of a
transaction reads one floor position for all of the transaction's keys (one round trip per
commit, not per key) and raises the writer's own floor with it, which saves the lazy read that
``metadata.replicas.lsn`` would otherwise make.

``InvalidationBus`` publishes the keys on a Redis pub/sub channel; a daemon thread per process
evicts them from the local tier. Pub/sub drops messages sent while a subscriber is disconnected,
so a (re)subscribed listener clears its local tiers before using them again; callers that wrote
are protected regardless (entries carry a position, ``metadata.cache.two_tier``).

This module knows the caches only as ``InvalidationTarget`` (what ``TwoTierCache`` provides), so
``two_tier`` imports it and nothing here imports ``two_tier``.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Protocol

from django.db import DatabaseError, connections, transaction

from core import tracing
from metadata.cache.redis_tier import RedisGuard
from metadata.replicas import lsn

logger = logging.getLogger(__name__)

CHANNEL = "specops:cache:invalidate"


def channel_of(client) -> str:
    """The channel of the Redis database ``client`` uses: pub/sub channels are server-wide (they
    ignore the database number), so deployments or test runs that share a server on different
    databases would evict each other's keys (as kombu prefixes its fanout channels with the db)."""
    return f"{CHANNEL}:{client.connection_pool.connection_kwargs.get('db', 0)}"


class InvalidationTarget(Protocol):
    """What an invalidation needs of a cache (``metadata.cache.two_tier.TwoTierCache``)."""

    name: str

    def apply_invalidation(self, ident: str, position: int) -> None:
        """After commit: drop (or refresh) ``ident`` in Redis and here, then broadcast it."""

    def apply_invalidations(self, idents: list[str], position: int) -> None:
        """``apply_invalidation`` of several idents, in one load, one Redis round trip and one broadcast."""

    def on_broadcast(self, key: str, position: int) -> None:
        """Another process changed ``key``."""

    def clear_local(self) -> None:
        """Forget every in-process entry (broadcasts may have been missed)."""


@dataclass
class _CommitBatch:
    """The invalidations of one transaction; they share one floor read."""

    position: int | None = None
    run_on_commit: list | None = field(default=None, repr=False)  # identifies the transaction

    def floor(self) -> int:
        if self.position is None:
            self.position = lsn.capture_primary_lsn()
            lsn.raise_floor(self.position, writes_captured=True)
        return self.position


_batches = threading.local()


def _current_batch() -> _CommitBatch:
    """One batch per transaction: Django replaces ``run_on_commit`` with a new list after each
    commit or rollback, so the list object identifies the open transaction."""
    connection = connections[lsn.PRIMARY_ALIAS]
    if not connection.in_atomic_block:
        return _CommitBatch()
    batch = getattr(_batches, "batch", None)
    if batch is None or batch.run_on_commit is not connection.run_on_commit:
        batch = _CommitBatch(run_on_commit=connection.run_on_commit)
        _batches.batch = batch
    return batch


def after_commit(cache: InvalidationTarget, ident: str) -> None:
    """Invalidate ``ident`` in ``cache`` once the current transaction commits (now if none).

    A rolled-back transaction (or savepoint) drops the hook, and with it the invalidation.
    """
    batch = _current_batch()
    transaction.on_commit(lambda: _apply(cache, ident, batch), using=lsn.PRIMARY_ALIAS)


def after_commit_many(cache: InvalidationTarget, idents: list[str]) -> None:
    """``after_commit`` of several idents as one hook: the batching worker's progress write
    changes every running session at once, and one by one each cost a reload and four Redis
    round trips on the writer thread (bench/README.md, "Abuse")."""
    if not idents:
        return
    batch = _current_batch()
    transaction.on_commit(lambda: _apply_many(cache, list(idents), batch), using=lsn.PRIMARY_ALIAS)


def _apply(cache: InvalidationTarget, ident: str, batch: _CommitBatch) -> None:
    """Never raise: the transaction has committed, and its caller must not see a cache error."""
    try:
        try:
            position = batch.floor()
        except DatabaseError:
            # Still drop the entry everywhere; without a position the key's floor cannot rise, so a
            # replica behind this write could refill it until the entry's TTL (logged).
            logger.exception("no floor position after commit; invalidating %s without one", ident)
            position = lsn.NO_LSN
        cache.apply_invalidation(ident, position)
    except Exception:
        logger.exception("cache invalidation of %s:%s failed; it expires with its TTL", cache.name, ident)


def _apply_many(cache: InvalidationTarget, idents: list[str], batch: _CommitBatch) -> None:
    """`_apply` of several idents: never raises."""
    try:
        try:
            position = batch.floor()
        except DatabaseError:
            logger.exception("no floor position after commit; invalidating %d keys without one", len(idents))
            position = lsn.NO_LSN
        cache.apply_invalidations(idents, position)
    except Exception:
        logger.exception("cache invalidation of %d keys of %s failed; they expire with their TTL",
                         len(idents), cache.name)


class InvalidationBus:
    """Pub/sub fan-out of local-tier evictions to every process of every host."""

    def __init__(self, guard: RedisGuard, reconnect_s: float = 0.5) -> None:
        self.guard = guard
        self.reconnect_s = reconnect_s
        self.origin = f"{os.uname().nodename}:{os.getpid()}:{id(self)}"
        self._caches: dict[str, list[InvalidationTarget]] = {}  # several per name: variants, tests
        self._thread: threading.Thread | None = None
        self._thread_pid = 0
        self._start_lock = threading.Lock()
        self._stop = threading.Event()
        self.connected = threading.Event()
        self.received = 0

    def register(self, cache: InvalidationTarget) -> None:
        self._caches.setdefault(cache.name, []).append(cache)

    def unregister(self, cache: InvalidationTarget) -> None:
        caches = self._caches.get(cache.name, [])
        if cache in caches:
            caches.remove(cache)

    def publish(self, cache_name: str, keys: list[str], position: int) -> None:
        message = json.dumps({"cache": cache_name, "keys": keys, "lsn": position, "origin": self.origin})
        self.guard.run(lambda client: client.publish(channel_of(client), message))

    def ensure_listening(self) -> None:
        """Start this process's listener (again after a fork); cheap when it runs."""
        if self._thread_pid == os.getpid():
            return
        with self._start_lock:
            if self._thread_pid == os.getpid():
                return
            self.connected = threading.Event()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._listen, name="specops-cache-invalidation", daemon=True)
            self._thread_pid = os.getpid()
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread_pid == os.getpid():
            self._thread.join(timeout=5)
        self._thread_pid = 0

    def _listen(self) -> None:
        while not self._stop.is_set():
            pubsub = None
            try:
                pubsub = self.guard.client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(channel_of(self.guard.client))
                pubsub.get_message(timeout=1.0)  # the subscribe confirmation
                # Anything published while we were away is lost: start from empty local tiers.
                for caches in list(self._caches.values()):
                    for cache in list(caches):
                        cache.clear_local()
                self.connected.set()
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is not None and message.get("type") == "message":
                        self._dispatch(message["data"])
            # Any exception, not only RedisError/OSError: redis-py can raise e.g. ValueError from a
            # socket closed under a reconnect, and a dead listener thread would never come back.
            except Exception as exc:
                if self.connected.is_set():
                    logger.warning("cache invalidation listener lost redis: %s", exc)
                self.connected.clear()
                self._stop.wait(self.reconnect_s)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:  # closing a broken connection may fail in any way
                        pass
        self.connected.clear()

    def _dispatch(self, data: bytes | str) -> None:
        try:
            message = json.loads(data)
            caches = list(self._caches.get(message["cache"], []))
            keys, position = message["keys"], int(message["lsn"])
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring malformed cache invalidation %r", data[:200])
            return
        self.received += 1
        # housekeeping of every process's caches: no request's trace (a Redis read here is no
        # span of its own, which would show as a root beside the request that caused it)
        with tracing.untraced():
            for cache in caches:
                for key in keys:
                    cache.on_broadcast(key, position)


_buses: dict[int, InvalidationBus] = {}
_buses_lock = threading.Lock()


def bus_for(guard: RedisGuard) -> InvalidationBus:
    """One bus (one listener thread) per Redis guard."""
    with _buses_lock:
        bus = _buses.get(id(guard))
        if bus is None:
            bus = _buses[id(guard)] = InvalidationBus(guard)
        return bus

