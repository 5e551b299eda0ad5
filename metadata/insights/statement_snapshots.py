"""Snapshots of pg_stat_statements: per-interval deltas per database alias, into a partitioned table.

pg_stat_statements counts from its last reset, for the whole server; a snapshot reads the counters
of this database on one alias (the primary, each replica: each server keeps its own), subtracts
the counters of the previous snapshot (``StatementBaseline``), and writes one
``StatementSnapshot`` row per statement that ran in the interval. The first snapshot of an alias
only records the baseline. A statement whose counters went down was evicted or reset and counts
from zero; so does every statement after ``pg_stat_statements_reset()`` (``stats_reset``).

Runs one at a time (``pg_try_advisory_lock`` on a direct connection); all writes go to the
primary in one transaction per alias, so a crash leaves the previous baseline intact.
"""
from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field

from django.conf import settings
from django.db import DatabaseError, connections, transaction
from django.utils import timezone

from metadata.insights.statements import describe
from metadata.models import PARTITIONED_TABLES, StatementBaseline, StatementSnapshot
from metadata.partitions import advisory_lock

logger = logging.getLogger(__name__)

SNAPSHOT_LOCK = 0x5350_4543_0010  # "SPEC" + 0x10; the partition locks are 1 and 2
MARKER_QUERYID = 0  # the baseline row that records an alias's last snapshot time
PRIMARY = "default"
COUNTERS = ("calls", "total_time_ms", "max_time_ms", "rows", "shared_blks_hit", "shared_blks_read",
            "shared_blks_dirtied", "shared_blks_written")

# Summed over roles and nesting levels: one row per statement of this database.
READ_SQL = """
SELECT s.queryid, min(s.query), sum(s.calls)::bigint, sum(s.total_exec_time), max(s.max_exec_time),
       sum(s.rows)::bigint, sum(s.shared_blks_hit)::bigint, sum(s.shared_blks_read)::bigint,
       sum(s.shared_blks_dirtied)::bigint, sum(s.shared_blks_written)::bigint
FROM pg_stat_statements s
WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) AND s.queryid IS NOT NULL
GROUP BY s.queryid
"""


class StatementsUnavailable(Exception):
    """pg_stat_statements cannot be read on an alias (extension missing, library not loaded, down)."""


@dataclass(frozen=True)
class Counters:
    query: str
    calls: int
    total_time_ms: float
    max_time_ms: float
    rows: int
    shared_blks_hit: int
    shared_blks_read: int
    shared_blks_dirtied: int
    shared_blks_written: int


@dataclass
class AliasSnapshot:
    database: str
    statements: int = 0  # rows written (statements that ran in the interval)
    interval_s: float | None = None  # None: the first snapshot, baseline only
    error: str = ""


@dataclass
class SnapshotReport:
    taken_at: dt.datetime
    databases: list[AliasSnapshot] = field(default_factory=list)

    def summary(self) -> str:
        parts = []
        for d in self.databases:
            if d.error:
                parts.append(f"{d.database}: skipped ({d.error})")
            elif d.interval_s is None:
                parts.append(f"{d.database}: baseline of the first snapshot")
            else:
                parts.append(f"{d.database}: {d.statements} statements over {d.interval_s:.0f} s")
        return "; ".join(parts)


def database_aliases() -> list[str]:
    """The primary and each replica (``direct`` is the primary's server again: not counted twice)."""
    return [PRIMARY, *settings.DATABASE_REPLICAS]


def read_counters(alias: str) -> tuple[dict[int, Counters], dt.datetime | None]:
    """This database's cumulative counters on ``alias``, and when they were last reset."""
    try:
        # A savepoint of its own: a failure must not abort the caller's transaction on that alias.
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute("SELECT to_regclass('pg_stat_statements') IS NOT NULL")
            if not cursor.fetchone()[0]:
                raise StatementsUnavailable("extension pg_stat_statements not created in this database")
            cursor.execute(READ_SQL)
            rows = cursor.fetchall()
            cursor.execute("SELECT stats_reset FROM pg_stat_statements_info")
            reset_at = cursor.fetchone()[0]
    except DatabaseError as exc:
        raise StatementsUnavailable(" ".join(str(exc).split())[:200]) from exc
    counters = {int(r[0]): Counters(r[1] or "", int(r[2]), float(r[3]), float(r[4]), int(r[5]), int(r[6]),
                                    int(r[7]), int(r[8]), int(r[9])) for r in rows}
    return counters, reset_at


def _delta(now: Counters, before: StatementBaseline | None) -> dict[str, float] | None:
    """The interval's counters, or None if the statement did not run in it."""
    if before is not None and now.calls < before.calls:
        before = None  # evicted and seen again, or reset: it counts from zero
    calls = now.calls - (before.calls if before else 0)
    if calls <= 0:
        return None
    delta = {name: getattr(now, name) - (getattr(before, name) if before else 0) for name in COUNTERS}
    total = max(delta["total_time_ms"], 0.0)
    delta["total_time_ms"] = total
    # A new maximum was set in this interval, or else the best lower bound we have: the mean.
    new_max = before is None or now.max_time_ms > before.max_time_ms
    delta["max_time_ms"] = now.max_time_ms if new_max else total / calls
    return delta


class StatementSnapshotter:
    """Take one snapshot of every database alias (or ``aliases``)."""

    def __init__(self, aliases: list[str] | None = None) -> None:
        self.aliases = aliases or database_aliases()
        self.parents = tuple(PARTITIONED_TABLES)

    def run(self, now: dt.datetime | None = None) -> SnapshotReport:
        """Snapshot every alias; ``MaintenanceLockBusy`` at once if another snapshot is running."""
        now = now or timezone.now()
        report = SnapshotReport(taken_at=now)
        with advisory_lock(SNAPSHOT_LOCK):  # on the direct connection when DATABASE_URL is PgBouncer
            for alias in self.aliases:
                report.databases.append(self.snapshot(alias, now))
        return report

    def snapshot(self, alias: str, now: dt.datetime) -> AliasSnapshot:
        result = AliasSnapshot(alias)
        try:
            counters, reset_at = read_counters(alias)
        except StatementsUnavailable as exc:
            result.error = str(exc)
            logger.info("statement snapshot of %s skipped: %s", alias, exc)
            return result
        with transaction.atomic(using=PRIMARY):
            baselines = {b.queryid: b for b in StatementBaseline.objects.using(PRIMARY)
                         .select_for_update().filter(database=alias)}
            marker = baselines.pop(MARKER_QUERYID, None)
            if marker is not None:
                if reset_at is not None and reset_at > marker.taken_at:
                    baselines = {}  # pg_stat_statements_reset() since: every counter starts over
                result.interval_s = max((now - marker.taken_at).total_seconds(), 1e-3)
                rows = self._rows(alias, now, result.interval_s, counters, baselines)
                StatementSnapshot.objects.using(PRIMARY).bulk_create(rows, batch_size=500)
                result.statements = len(rows)
            self._save_baselines(alias, now, counters, baselines, marker is None)
        return result

    def _rows(self, alias: str, now: dt.datetime, interval_s: float, counters: dict[int, Counters],
              baselines: dict[int, StatementBaseline]) -> list[StatementSnapshot]:
        rows = []
        for queryid, current in counters.items():
            delta = _delta(current, baselines.get(queryid))
            if delta is None:
                continue
            text = describe(current.query, self.parents)
            rows.append(StatementSnapshot(
                taken_at=now, interval_s=interval_s, database=alias, queryid=queryid, query=text.query,
                family=text.family, source=text.source, **{k: v for k, v in delta.items()}))
        return rows

    def _save_baselines(self, alias: str, now: dt.datetime, counters: dict[int, Counters],
                        baselines: dict[int, StatementBaseline], first: bool) -> None:
        """Upsert the counters that changed (all of them the first time), forget evicted statements."""
        changed = [StatementBaseline(database=alias, queryid=queryid, taken_at=now, query=current.query,
                                     **{name: getattr(current, name) for name in COUNTERS})
                   for queryid, current in counters.items()
                   if first or queryid not in baselines or baselines[queryid].calls != current.calls]
        changed.append(StatementBaseline(database=alias, queryid=MARKER_QUERYID, taken_at=now))
        StatementBaseline.objects.using(PRIMARY).bulk_create(
            changed, batch_size=500, update_conflicts=True, unique_fields=["database", "queryid"],
            update_fields=["taken_at", "query", *COUNTERS])
        gone = [queryid for queryid in baselines if queryid not in counters]
        if gone:
            StatementBaseline.objects.using(PRIMARY).filter(database=alias, queryid__in=gone).delete()


def take_snapshot(aliases: list[str] | None = None, now: dt.datetime | None = None) -> SnapshotReport:
    """One snapshot of every database alias (what the beat job runs)."""
    return StatementSnapshotter(aliases).run(now)
