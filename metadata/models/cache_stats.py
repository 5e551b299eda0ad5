"""Cache counters over time, written by ``metadata.cache.stats_snapshots`` for the admin's hit-rate charts."""
from __future__ import annotations

from django.db import models
from django.utils import timezone


class CacheStatsSnapshot(models.Model):
    """Cache counters of one process at one moment, so the admin can chart hit rates."""

    taken_at = models.DateTimeField(default=timezone.now, db_index=True)
    cache = models.CharField(max_length=32)  # e.g. "session_state", "prediction"
    tier = models.CharField(max_length=16)  # "local" | "redis"
    hits = models.BigIntegerField(default=0)
    misses = models.BigIntegerField(default=0)
    coalesced = models.BigIntegerField(default=0)

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None
