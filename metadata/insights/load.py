"""Observed load, read cheaply: statement rates from the snapshots, traffic from the metadata tables,
storage growth from pg_catalog. The inputs of the capacity plan (``metadata.insights.capacity``).

Every query has a time range on a partition key (``taken_at``, ``session_created_at``) or reads
the catalog, so it touches only the partitions of the window.
"""
from __future__ import annotations

import datetime as dt
import os
import shutil
from dataclasses import dataclass, field

from django.conf import settings
from django.db import DatabaseError, connections
from django.utils import timezone

from metadata.conf import conf
from metadata.insights.window import Window
from metadata.models import PARTITIONED_TABLES, Session, StatementSnapshot, TokenRecord
from metadata.partitions import catalog

PRIMARY = "default"
SERIES_POINTS = 120
BUCKET_ORIGIN = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)  # fixed: a peak does not move with "now"

_INTERVALS_SQL = """
SELECT database, taken_at, max(interval_s), sum(calls)::bigint, sum(total_time_ms),
       coalesce(sum(total_time_ms) FILTER (WHERE left(family, 6) = 'select'), 0),
       sum(shared_blks_read + shared_blks_written)::bigint
FROM {table} WHERE taken_at > %s AND taken_at <= %s
GROUP BY database, taken_at ORDER BY database, taken_at
"""
_FAMILIES_SQL = """
SELECT database, family, sum(calls)::bigint, max(calls / interval_s),
       (array_agg(taken_at ORDER BY calls / interval_s DESC))[1]
FROM (
    SELECT database, family, taken_at, max(interval_s) AS interval_s, sum(calls) AS calls
    FROM {table} WHERE taken_at > %s AND taken_at <= %s
    GROUP BY database, family, taken_at
) per_interval
GROUP BY database, family
"""
_BUCKETS_SQL = """
SELECT date_bin(%s, {column}, %s) AS bucket, count(*) FROM {table}
WHERE {column} > %s AND {column} <= %s GROUP BY 1
"""


@dataclass(frozen=True)
class Rate:
    """A per-second rate over the window: its average, and its peak (one snapshot or bucket)."""

    average: float
    peak: float
    peak_at: dt.datetime | None = None


ZERO = Rate(0.0, 0.0)


@dataclass
class DatabaseLoad:
    database: str
    snapshots: int
    covered_s: float  # seconds of the window the snapshots cover
    statements: Rate  # statements per second
    busy: Rate  # statements executing at once: execution time per second of wall time
    read_busy: Rate  # of which SELECTs
    iops: Rate  # shared blocks read from the OS or written, per second (an upper bound of disk IOPS)
    families: list[tuple[str, Rate]] = field(default_factory=list)  # by peak, highest first
    series: list[tuple[dt.datetime, float]] = field(default_factory=list)  # statements/s, for a chart


def _rate(values: list[tuple[dt.datetime, float, float]]) -> Rate:
    """``values``: (moment, amount, seconds) per interval → average over all, peak of one."""
    seconds = sum(s for _, _, s in values)
    if not values or seconds <= 0:
        return ZERO
    at, amount, span = max(values, key=lambda v: v[1] / v[2] if v[2] else 0.0)
    return Rate(sum(a for _, a, _ in values) / seconds, amount / span if span else 0.0, at)


def _downsample(points: list[tuple[dt.datetime, float]], limit: int = SERIES_POINTS) -> list[tuple[dt.datetime, float]]:
    if len(points) <= limit:
        return points
    step = len(points) / limit
    return [max(points[int(i * step): int((i + 1) * step)], key=lambda p: p[1]) for i in range(limit)]


def database_loads(window: Window) -> list[DatabaseLoad]:
    """Statement rates per database alias and family over ``window``, from the snapshots."""
    table = StatementSnapshot._meta.db_table
    with connections[PRIMARY].cursor() as cursor:
        cursor.execute(_INTERVALS_SQL.format(table=table), [window.start, window.end])
        intervals = cursor.fetchall()
        cursor.execute(_FAMILIES_SQL.format(table=table), [window.start, window.end])
        families = cursor.fetchall()
    by_database: dict[str, list] = {}
    for row in intervals:
        by_database.setdefault(row[0], []).append(row[1:])
    loads = {}
    for database, rows in by_database.items():
        covered = sum(r[1] for r in rows)
        loads[database] = DatabaseLoad(
            database=database, snapshots=len(rows), covered_s=covered,
            statements=_rate([(at, calls, s) for at, s, calls, _, _, _ in rows]),
            busy=_rate([(at, ms / 1000, s) for at, s, _, ms, _, _ in rows]),
            read_busy=_rate([(at, ms / 1000, s) for at, s, _, _, ms, _ in rows]),
            iops=_rate([(at, blocks, s) for at, s, _, _, _, blocks in rows]),
            series=_downsample([(at, calls / s if s else 0.0) for at, s, calls, _, _, _ in rows]),
        )
    for database, family, calls, peak, peak_at in families:
        load = loads.get(database)
        if load is not None and load.covered_s > 0:
            load.families.append((family, Rate(calls / load.covered_s, float(peak or 0), peak_at)))
    for load in loads.values():
        load.families.sort(key=lambda item: -item[1].peak)
    return [loads[d] for d in sorted(loads, key=lambda d: (d != PRIMARY, d))]


def traffic_rate(model, column: str, window: Window, bucket_s: int) -> tuple[Rate, list[tuple[dt.datetime, float]]]:
    """Rows per second of ``model`` by ``column`` in ``bucket_s`` buckets: average and peak, and the series."""
    width = dt.timedelta(seconds=bucket_s)
    sql = _BUCKETS_SQL.format(table=model._meta.db_table, column=connections[PRIMARY].ops.quote_name(column))
    with connections[PRIMARY].cursor() as cursor:
        cursor.execute(sql, [width, BUCKET_ORIGIN, window.start, window.end])
        buckets = sorted(cursor.fetchall())
    if not buckets:
        return ZERO, []
    at, count = max(buckets, key=lambda b: b[1])
    series = _downsample([(b, c / bucket_s) for b, c in buckets])
    return Rate(sum(c for _, c in buckets) / window.seconds, count / bucket_s, at), series


def tokens_and_sessions(window: Window, bucket_s: int) -> dict[str, tuple[Rate, list]]:
    """Tokens by their session's creation time (the token table's partition key), sessions by theirs."""
    return {
        "tokens": traffic_rate(TokenRecord, "session_created_at", window, bucket_s),
        "sessions": traffic_rate(Session, "created_at", window, bucket_s),
    }


@dataclass(frozen=True)
class TableGrowth:
    table: str
    partitions: int
    total_bytes: int
    bytes_per_day: float  # over the partitions of the lookback, each by the part of its range already past


@dataclass(frozen=True)
class Storage:
    tables: list[TableGrowth]
    free_bytes: int | None
    free_source: str  # the setting, the data directory measured, or why it is unknown

    @property
    def total_bytes(self) -> int:
        return sum(t.total_bytes for t in self.tables)

    @property
    def bytes_per_day(self) -> float:
        return sum(t.bytes_per_day for t in self.tables)


def table_growth(parent: str, now: dt.datetime, lookback: dt.timedelta) -> TableGrowth:
    partitions = catalog.range_partitions(parent, PRIMARY, sizes=True)
    default = catalog.default_partition(parent, PRIMARY, sizes=True)
    recent_bytes, recent_days = 0, 0.0
    for p in partitions:
        if p.bounds.start >= now or p.bounds.end <= now - lookback:
            continue
        recent_bytes += p.total_bytes
        recent_days += (min(p.bounds.end, now) - p.bounds.start).total_seconds() / 86400
    total = sum(p.total_bytes for p in partitions) + (default.total_bytes if default else 0)
    return TableGrowth(parent, len(partitions), total, recent_bytes / recent_days if recent_days else 0.0)


def disk_free() -> tuple[int | None, str]:
    """Free bytes for the database: the setting, else the data directory's file system if it is here."""
    configured = int(conf.CAPACITY_DISK_FREE_BYTES)
    if configured > 0:
        return configured, "SPECOPS_CAPACITY_DISK_FREE_BYTES"
    try:
        with connections[PRIMARY].cursor() as cursor:
            cursor.execute("SHOW data_directory")
            directory = cursor.fetchone()[0]
    except DatabaseError:
        return None, "unknown (data_directory not readable: set SPECOPS_CAPACITY_DISK_FREE_BYTES)"
    if not os.path.isdir(directory):
        return None, f"unknown ({directory} is not on this host: set SPECOPS_CAPACITY_DISK_FREE_BYTES)"
    return shutil.disk_usage(directory).free, f"free space of {directory}"


def storage(now: dt.datetime | None = None, lookback_days: float = 7.0) -> Storage:
    now = now or timezone.now()
    lookback = dt.timedelta(days=lookback_days)
    tables = [table_growth(parent, now, lookback) for parent in PARTITIONED_TABLES]
    free, source = disk_free()
    return Storage(tables, free, source)


def pool_max_size(alias: str) -> int | None:
    return settings.DATABASES.get(alias, {}).get("OPTIONS", {}).get("pool", {}).get("max_size")


def max_connections(alias: str) -> int | None:
    try:
        with connections[alias].cursor() as cursor:
            cursor.execute("SHOW max_connections")
            return int(cursor.fetchone()[0])
    except DatabaseError:
        return None
