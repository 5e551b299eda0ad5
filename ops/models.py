"""The operators' rollups: what the dashboard reads instead of raw rows.

The table keeps the name it had when the model was ``metadata``'s (``metadata_ops_rollup``,
created by metadata migration 0006): the model moved to this app in state only
(``ops`` migration 0001, metadata migration 0013), so no table changed.
"""
from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.utils import timezone


class RollupWidth(models.IntegerChoices):
    MINUTE = 1, "minute"
    HOUR = 60, "hour"


class OpsRollup(models.Model):
    """One minute (or hour) of one operational series: what the dashboard reads instead of raw rows.

    ``series`` names what was aggregated and ``key`` its label (a drafter, a device queue, a
    cache tier, a replica, a status class). ``count``, ``total`` and the latency histogram
    ``buckets`` (counts over the fixed edges of ``core.histograms``) merge by addition, and
    ``values`` holds further sums (``*_max`` merge by max, lists element-wise), so minutes add up
    into hours and hours into any window. Written by ``ops.rollups``; each series is
    described there.
    """

    start = models.DateTimeField()  # UTC, truncated to the width
    width = models.PositiveSmallIntegerField(choices=RollupWidth.choices, default=RollupWidth.MINUTE)
    series = models.CharField(max_length=24)
    key = models.CharField(max_length=100, blank=True, default="")
    count = models.BigIntegerField(default=0)
    total = models.FloatField(default=0.0)
    buckets = ArrayField(models.BigIntegerField(), default=list, blank=True)
    values = models.JSONField(default=dict, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "metadata_ops_rollup"
        constraints = [
            models.UniqueConstraint(fields=["width", "series", "key", "start"], name="ops_rollup_one_per_slot"),
        ]
        indexes = [models.Index(fields=["width", "start"], name="ops_rollup_by_time")]

    def __str__(self) -> str:
        return f"{self.series}[{self.key}] {self.start:%Y-%m-%d %H:%M} ({self.get_width_display()})"
