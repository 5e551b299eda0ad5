"""The two-tier metadata cache: an in-process tier in front of Redis, invalidated after commit.

``TwoTierCache`` is one kind of cached data (a loader returning ``Versioned`` values) under a
``WritePolicy``; ``invalidate`` runs after the transaction commits and is broadcast to every
process's local tier. Redis is reached through a ``RedisGuard``, which skips it while it is down
(reads then go to the database). ``CacheStats`` counts hits, misses and coalesced waits per tier;
``snapshot_cache_stats_now`` turns the counts of every process into ``CacheStatsSnapshot`` rows.

Modules: ``two_tier`` (the cache), ``local_tier`` (in-process TTL LRU), ``redis_tier`` (Redis
tier, guard, versioned values), ``invalidation`` (after-commit hooks and the pub/sub bus),
``counters`` (counters), ``stats_snapshots`` (the beat task that stores them), ``codec`` (the
typed, versioned JSON of every value in Redis: nothing read from Redis is unpickled), ``rows``
(model rows as cacheable values).
"""
from __future__ import annotations

from typing import Any

from metadata.cache.counters import COALESCED, HITS, LOCAL, MISSES, REDIS, CacheStats
from metadata.cache.invalidation import InvalidationBus, InvalidationTarget, after_commit
from metadata.cache.redis_tier import (
    PLAIN_VALUES,
    UNAVAILABLE,
    RedisGuard,
    ValueCodec,
    Versioned,
    default_guard,
    fail_fast_client,
)
from metadata.cache.two_tier import CacheConfig, Loader, TwoTierCache, WritePolicy

__all__ = [
    "COALESCED", "HITS", "LOCAL", "MISSES", "PLAIN_VALUES", "REDIS", "UNAVAILABLE",
    "CacheConfig", "CacheStats", "InvalidationBus", "InvalidationTarget", "Loader", "RedisGuard",
    "TwoTierCache", "ValueCodec", "Versioned", "WritePolicy",
    "after_commit", "default_guard", "fail_fast_client", "snapshot_cache_stats_now",
]


def __getattr__(name: str) -> Any:
    """The snapshot needs the models: loaded on first use, so importing the cache does not."""
    if name == "snapshot_cache_stats_now":
        from metadata.cache.stats_snapshots import snapshot_cache_stats_now

        return snapshot_cache_stats_now
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
