"""Cache counters: hits, misses and coalesced waits, per cache and tier.

Counted twice on purpose. Prometheus counters serve live dashboards. Plain per-process deltas
are added into one Redis hash every few seconds, so the periodic snapshot
(``metadata.cache.stats_snapshots``) can write one row per cache and tier covering every process: a Celery
task only sees its own process's counters, which are not the API's.
"""
from __future__ import annotations

import threading
import time
from collections import Counter as Tally

from prometheus_client import REGISTRY, Counter
from prometheus_client.registry import Collector

from metadata.cache.redis_tier import UNAVAILABLE, RedisGuard
from metadata.conf import conf

LOCAL = "local"
REDIS = "redis"
TIERS = (LOCAL, REDIS)
HITS, MISSES, COALESCED = "hits", "misses", "coalesced"
EVENTS = (HITS, MISSES, COALESCED)
STATS_HASH = "specops:cache:stats"  # field "<cache>|<tier>|<event>" -> count not yet snapshotted

class _ExportOnScrape(Collector):
    """Bring the counters up to date when Prometheus scrapes this process. Registered before
    CACHE_EVENTS: the registry collects in registration order."""

    def describe(self):
        return []

    def collect(self):
        for stats in list(_ALL_STATS):
            stats.export_to_prometheus()
        return []


REGISTRY.register(_ExportOnScrape())

CACHE_EVENTS = Counter(
    "specops_cache_events", "Cache lookups by cache, tier and outcome (hits, misses, coalesced waits).",
    ["cache", "tier", "event"],
)


class CacheStats:
    """The counters of one cache in this process.

    Each thread counts into its own dict: a shared lock (ours, or the one inside every
    prometheus_client counter) taken on every lookup made lock convoys under the burst, as in
    ``metadata.cache.local_tier``. The counts reach Prometheus when it scrapes and with every flush to
    Redis (every ``SPECOPS_CACHE_STATS_FLUSH_S``, from the lookups themselves).
    """

    def __init__(self, cache_name: str) -> None:
        self.cache_name = cache_name
        self._lock = threading.Lock()
        self._thread = threading.local()
        self._tallies: list[dict[tuple[str, str], int]] = []
        self._exported: Tally[tuple[str, str]] = Tally()  # already added to the Prometheus counter
        self._sent: Tally[tuple[str, str]] = Tally()  # already added to the Redis hash
        self._children = {(t, e): CACHE_EVENTS.labels(cache_name, t, e) for t in TIERS for e in EVENTS}
        _ALL_STATS.append(self)

    def record(self, tier: str, event: str, count: int = 1) -> None:
        tally = getattr(self._thread, "tally", None)
        if tally is None:
            # Every key exists from the start, so a reader copying it never sees the dict resize.
            tally = self._thread.tally = {(t, e): 0 for t in TIERS for e in EVENTS}
            with self._lock:
                self._tallies.append(tally)
        tally[(tier, event)] += count

    def this_thread(self, tier: str, event: str) -> int:
        """The calling thread's count (the benchmark tells local hits apart with it)."""
        tally = getattr(self._thread, "tally", None)
        return tally[(tier, event)] if tally is not None else 0

    def totals(self) -> Tally[tuple[str, str]]:
        """Since this process started, all threads (tests and the benchmark read it)."""
        with self._lock:
            return self.totals_unlocked()

    def total(self, tier: str, event: str) -> int:
        return self.totals()[(tier, event)]

    def export_to_prometheus(self) -> None:
        with self._lock:
            totals = self.totals_unlocked()
            for key, count in (totals - self._exported).items():
                self._children[key].inc(count)
            self._exported = totals

    def take_unsent(self) -> Tally[tuple[str, str]]:
        with self._lock:
            totals = self.totals_unlocked()
            unsent, self._sent = totals - self._sent, totals
        return unsent

    def give_back(self, counts: Tally[tuple[str, str]]) -> None:
        with self._lock:
            self._sent.subtract(counts)

    def totals_unlocked(self) -> Tally[tuple[str, str]]:
        """Call with ``_lock`` held (it guards the list of tallies, not their counts)."""
        totals: Tally[tuple[str, str]] = Tally()
        for tally in self._tallies:
            totals.update(dict(tally))
        return totals


_ALL_STATS: list[CacheStats] = []
_flush_lock = threading.Lock()
_next_flush = 0.0


def flush_to_redis(guard: RedisGuard) -> bool:
    """Bring the Prometheus counters up to date and add every cache's unsent counts of this
    process into the shared hash."""
    for stats in list(_ALL_STATS):
        stats.export_to_prometheus()
    taken = [(stats, stats.take_unsent()) for stats in list(_ALL_STATS)]
    fields = {
        f"{stats.cache_name}|{tier}|{event}": count
        for stats, counts in taken for (tier, event), count in counts.items() if count
    }
    if not fields:
        return True

    def add(client) -> None:
        pipe = client.pipeline(transaction=False)
        for field, count in fields.items():
            pipe.hincrby(STATS_HASH, field, count)
        pipe.execute()

    if guard.run(add) is UNAVAILABLE:
        for stats, counts in taken:
            stats.give_back(counts)
        return False
    return True


def maybe_flush_to_redis(guard: RedisGuard) -> None:
    """Flush at most every ``SPECOPS_CACHE_STATS_FLUSH_S``; cheap to call on every lookup."""
    global _next_flush
    now = time.monotonic()
    if now < _next_flush or not _flush_lock.acquire(blocking=False):
        return
    try:
        if now >= _next_flush:
            _next_flush = now + conf.CACHE_STATS_FLUSH_S
            flush_to_redis(guard)
    finally:
        _flush_lock.release()
