"""pg_stat_statements, kept: per-interval deltas (partitioned on ``taken_at``) and their baselines.

Written by ``metadata.insights.statement_snapshots``; read by the hot-queries, heatmap and
capacity pages of ``metadata.insights``.
"""
from __future__ import annotations

from django.db import models


class StatementSnapshot(models.Model):
    """One statement's work on one database during one snapshot interval; partitioned by ``taken_at``.

    Deltas of ``pg_stat_statements`` between two snapshots of the same database alias (the
    ``metadata.insights.snapshot_statements`` beat job). ``max_time_ms``: PostgreSQL 15 keeps
    only the maximum since the statistics were reset, so it is exact when the statement set a new
    maximum in the interval, else the interval's mean (a lower bound of its true maximum).
    """

    pk = models.CompositePrimaryKey("database", "queryid", "taken_at")
    taken_at = models.DateTimeField()
    interval_s = models.FloatField()  # since the previous snapshot of this database
    database = models.CharField(max_length=32)  # the Django alias: "default", "replica_0", ...
    queryid = models.BigIntegerField()
    query = models.TextField()  # normalised text (constants as $n, lists collapsed, tag removed)
    family = models.CharField(max_length=100)  # statement kind and main table, e.g. "select metadata_token"
    source = models.CharField(max_length=200, blank=True, default="")  # "view=…" or "task=…", from the SQL tag
    calls = models.BigIntegerField()
    total_time_ms = models.FloatField()
    max_time_ms = models.FloatField()
    rows = models.BigIntegerField()
    shared_blks_hit = models.BigIntegerField()
    shared_blks_read = models.BigIntegerField()
    shared_blks_dirtied = models.BigIntegerField()
    shared_blks_written = models.BigIntegerField()

    class Meta:
        db_table = "metadata_statement_snapshot"

    @property
    def mean_time_ms(self) -> float:
        return self.total_time_ms / self.calls if self.calls else 0.0


class StatementBaseline(models.Model):
    """The cumulative ``pg_stat_statements`` counters a database alias showed at its last snapshot.

    Small (one row per statement and alias, updated in place): the next snapshot's deltas are
    computed against it. The row with ``queryid`` 0 (no real statement has it) records the last
    snapshot time of the alias itself.
    """

    database = models.CharField(max_length=32)
    queryid = models.BigIntegerField()
    taken_at = models.DateTimeField()
    query = models.TextField(blank=True, default="")  # as pg_stat_statements shows it: EXPLAIN can prepare it
    calls = models.BigIntegerField(default=0)
    total_time_ms = models.FloatField(default=0.0)
    max_time_ms = models.FloatField(default=0.0)
    rows = models.BigIntegerField(default=0)
    shared_blks_hit = models.BigIntegerField(default=0)
    shared_blks_read = models.BigIntegerField(default=0)
    shared_blks_dirtied = models.BigIntegerField(default=0)
    shared_blks_written = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["database", "queryid"], name="one_baseline_per_statement")]

    def __str__(self) -> str:
        return f"{self.database} {self.queryid}"
