"""Periodic snapshot of the cache counters into ``CacheStatsSnapshot`` (admin hit-rate charts).

Every process adds its counts into one Redis hash (``metadata.cache.counters``); this task turns
what accumulated since the last run into one row per cache and tier, then subtracts exactly what
it wrote (not a reset), so counts added meanwhile are kept for the next run. A crash between the
insert and the subtraction counts an interval twice; losing it would be worse for a hit-rate
chart than a spike that the admin can see.
"""
from __future__ import annotations

from collections import defaultdict

from celery import shared_task
from django.db import transaction
from django.utils import timezone

from core.queues import MAINTENANCE_QUEUE
from metadata.cache.counters import EVENTS, STATS_HASH, flush_to_redis
from metadata.cache.redis_tier import UNAVAILABLE, RedisGuard, default_guard
from metadata.models import CacheStatsSnapshot


def snapshot_cache_stats_now(guard: RedisGuard | None = None) -> int:
    """Write the accumulated counts as snapshot rows; return how many rows were written."""
    guard = guard or default_guard()
    flush_to_redis(guard)  # this process's own counts too
    raw = guard.run(lambda client: client.hgetall(STATS_HASH))
    if raw is UNAVAILABLE or not raw:
        return 0
    counts: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(EVENTS, 0))
    for field, value in raw.items():
        cache, tier, event = field.decode().split("|")
        if event in EVENTS:
            counts[(cache, tier)][event] = int(value)
    taken_at = timezone.now()
    rows = [
        CacheStatsSnapshot(taken_at=taken_at, cache=cache, tier=tier, **events)
        for (cache, tier), events in sorted(counts.items()) if any(events.values())
    ]
    with transaction.atomic():
        CacheStatsSnapshot.objects.bulk_create(rows)

    def subtract(client) -> None:
        pipe = client.pipeline(transaction=True)
        for field, value in raw.items():
            pipe.hincrby(STATS_HASH, field, -int(value))
        pipe.execute()

    guard.run(subtract)
    return len(rows)


@shared_task(name="metadata.cache.snapshot_cache_stats", queue=MAINTENANCE_QUEUE)
def snapshot_cache_stats() -> int:
    """Beat entry: every minute."""
    return snapshot_cache_stats_now()
