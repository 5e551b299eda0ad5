"""Partition lifecycle: make partitions ahead, drain the DEFAULT partition, archive expired ones.

``PartitionRotation.run()`` is idempotent and safe to run as often as wanted: it holds an
advisory lock (runs never overlap), resumes unfinished archival jobs, makes every missing
partition from the current bin to ``premake`` bins ahead (and one for every bin that has rows
stranded in the DEFAULT partition), then archives partitions past retention
(``metadata.archival.archiver``). Ranges come from the catalog's bounds, never from table names.

A partition is made as a standalone table ``LIKE`` the parent with a CHECK on its bounds, filled
with the DEFAULT partition's rows of its range in committed batches, then attached in one short
transaction under ``lock_timeout`` (retried) that:

* takes SHARE on the parent: inserts wait for these few milliseconds, reads do not. Without it an
  insert that had routed a row of the new range to DEFAULT just before the ATTACH fails just
  after it ("violates partition constraint": its partition descriptor predates the ATTACH);
* locks DEFAULT and moves the last stragglers, so ATTACH never meets a row it would refuse;
* ATTACHes (``CREATE TABLE ... PARTITION OF`` would hold ACCESS EXCLUSIVE, blocking reads too).

A half-drained table is marked in its table comment and finished by the next run. Rows being
moved sit in the not-yet-attached table while the drain runs: not lost, but not visible through
the parent until the ATTACH. Long work is paced (``metadata.partitions.pacing``) to leave writers CPU.
"""
from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.utils import timezone

from metadata.archival.archiver import CrashPoint, PartitionArchiver, expired
from metadata.conf import conf
from metadata.models import PARTITIONED_TABLES, ArchivalStep
from metadata.partitions import catalog
from metadata.partitions.bounds import (
    BadIntervalError,
    TimeRange,
    bin_start,
    bins,
    parse_interval,
    partition_name,
    uncovered,
)
from metadata.partitions.locks import (
    PARTITION_MAINTENANCE_LOCK,
    advisory_lock,
    literal,
    quote,
    with_lock_retries,
)
from metadata.partitions.pacing import Pacer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionPolicy:
    """How partitions are cut and kept; read from settings, overridable in tests and commands."""

    interval: dt.timedelta = dt.timedelta(days=1)
    premake: int = 4
    retention: dt.timedelta = dt.timedelta(days=30)
    drain_batch_rows: int = 5000
    max_default_bins: int = 100  # bins of stranded rows drained per run, against a flood of bad timestamps
    max_archives_per_run: int = 50

    @classmethod
    def from_settings(cls) -> PartitionPolicy:
        """Build the policy from SPECOPS_PARTITION_* settings; bad values are ImproperlyConfigured."""
        try:
            interval = parse_interval(str(conf.PARTITION_INTERVAL))
        except BadIntervalError as exc:
            raise ImproperlyConfigured(f"SPECOPS_PARTITION_INTERVAL: {exc}") from exc
        premake = int(conf.PARTITION_PREMAKE)
        retention_days = float(conf.PARTITION_RETENTION_DAYS)
        if premake < 1:
            raise ImproperlyConfigured("SPECOPS_PARTITION_PREMAKE must be at least 1")
        if retention_days <= 0:
            raise ImproperlyConfigured("SPECOPS_PARTITION_RETENTION_DAYS must be positive")
        return cls(interval=interval, premake=premake, retention=dt.timedelta(days=retention_days))


@dataclass
class RotationReport:
    """What one rotation did, for the command's output and the Celery task's result."""

    created: list[str] = field(default_factory=list)
    drained_rows: int = 0
    archived: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    default_rows: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        return (f"created {len(self.created)} partition(s), drained {self.drained_rows} row(s) from DEFAULT, "
                f"archived {len(self.archived)}, failed {len(self.failed)}")


class PartitionMaker:
    """Make the RANGE partitions of one parent table, draining DEFAULT rows into them."""

    def __init__(self, parent: str, column: str, policy: PartitionPolicy, progress: Callable[[str], None],
                 using: str = DEFAULT_DB_ALIAS, pacer: Pacer | None = None) -> None:
        self.parent, self.column, self.policy, self.progress, self.using = parent, column, policy, progress, using
        self.pacer = pacer or Pacer()

    def wanted_ranges(self, now: dt.datetime) -> list[TimeRange]:
        """Missing ranges: from the bin holding ``now`` to ``premake`` bins ahead, and every bin
        with rows in DEFAULT; only the parts no existing partition covers (bounds, not names)."""
        current = bin_start(now, self.policy.interval)
        ahead = list(bins(current, current + self.policy.interval * (self.policy.premake + 1), self.policy.interval))
        stranded = [r for r, _ in catalog.default_bins(self.parent, self.column, self.policy.interval,
                                                        self.policy.max_default_bins, self.using)]
        existing = [p.bounds for p in catalog.range_partitions(self.parent, self.using)]
        gaps: set[TimeRange] = set()
        for wanted in ahead + stranded:
            gaps.update(uncovered(wanted, existing))
        return sorted(gaps)

    def ensure(self, now: dt.datetime) -> tuple[list[str], int]:
        """Finish half-drained tables, then make every missing range; (names made, rows moved)."""
        made, moved = [], 0
        for name, bounds in catalog.staging_tables(self.parent, self.using):
            moved += self._fill_and_attach(name, bounds)
            made.append(name)
        for bounds in self.wanted_ranges(now):
            name = self._create_staging(bounds)
            moved += self._fill_and_attach(name, bounds)
            made.append(name)
            self.pacer.pause()
        return made, moved

    def _create_staging(self, bounds: TimeRange) -> str:
        name = catalog.free_name(partition_name(self.parent, bounds), self.using)
        col = quote(self.column, self.using)
        with transaction.atomic(using=self.using), connections[self.using].cursor() as cursor:
            cursor.execute(
                f"CREATE TABLE {quote(name)} (LIKE {quote(self.parent)} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
            )
            cursor.execute(
                f"ALTER TABLE {quote(name)} ADD CONSTRAINT {quote(name[:55] + '_bound')} CHECK ("
                f"{col} IS NOT NULL AND {col} >= {literal(bounds.start)} AND {col} < {literal(bounds.end)})"
            )
            cursor.execute(f"COMMENT ON TABLE {quote(name)} IS {literal(catalog.staging_comment(self.parent, bounds))}")
        return name

    def _move_sql(self, default: str, target: str, bounds: TimeRange, limit: int | None) -> str:
        columns = ", ".join(quote(c) for c in catalog.table_columns(self.parent, self.using))
        col = quote(self.column)
        where = f"{col} >= {literal(bounds.start)} AND {col} < {literal(bounds.end)}"
        if limit is None:
            picked = f"DELETE FROM {quote(default)} WHERE {where}"
        else:
            picked = (f"DELETE FROM {quote(default)} WHERE ctid = ANY(ARRAY("
                      f"SELECT ctid FROM {quote(default)} WHERE {where} LIMIT {int(limit)} FOR UPDATE SKIP LOCKED))")
        return (f"WITH moved AS ({picked} RETURNING {columns}) "
                f"INSERT INTO {quote(target)} ({columns}) SELECT {columns} FROM moved")

    def _fill_and_attach(self, name: str, bounds: TimeRange) -> int:
        default = catalog.default_partition(self.parent, self.using)
        moved = 0
        if default is not None:
            batch = self._move_sql(default.name, name, bounds, self.policy.drain_batch_rows)
            while True:
                with transaction.atomic(using=self.using), connections[self.using].cursor() as cursor:
                    cursor.execute(batch)
                    count = cursor.rowcount
                moved += count
                self.pacer.pause()
                if count:
                    self.progress(f"{self.parent}: moved {moved} row(s) from {default.name} into {name}")
                if count < self.policy.drain_batch_rows:
                    break

        def attach() -> int:
            stragglers = 0
            with connections[self.using].cursor() as cursor:
                # SHARE on the parent holds inserts back for these few milliseconds (see module doc).
                cursor.execute(f"LOCK TABLE {quote(self.parent)} IN SHARE MODE")
                if default is not None:
                    cursor.execute(f"LOCK TABLE {quote(default.name)} IN ACCESS EXCLUSIVE MODE")
                    cursor.execute(self._move_sql(default.name, name, bounds, None))
                    stragglers = cursor.rowcount
                cursor.execute(
                    f"ALTER TABLE {quote(self.parent)} ATTACH PARTITION {quote(name)} "
                    f"FOR VALUES FROM ({literal(bounds.start)}) TO ({literal(bounds.end)})"
                )
                cursor.execute(f"ALTER TABLE {quote(name)} DROP CONSTRAINT IF EXISTS {quote(name[:55] + '_bound')}")
                cursor.execute(f"COMMENT ON TABLE {quote(name)} IS NULL")
            return stragglers

        moved += with_lock_retries(attach, f"attach {name}", self.using)
        self.progress(f"{self.parent}: attached {name} {bounds}")
        return moved


class PartitionRotation:
    """One maintenance run over every partitioned table, under the advisory lock."""

    def __init__(
        self,
        policy: PartitionPolicy | None = None,
        tables: dict[str, str] | None = None,
        archive_dir: Path | None = None,
        progress: Callable[[str], None] | None = None,
        crash_at: CrashPoint | None = None,
        using: str = DEFAULT_DB_ALIAS,
        pacer: Pacer | None = None,
    ) -> None:
        self.policy = policy or PartitionPolicy.from_settings()
        self.tables = dict(PARTITIONED_TABLES if tables is None else tables)
        self.progress = progress or logger.info
        self.pacer = pacer or Pacer()
        self.archiver = PartitionArchiver(archive_dir, self.progress, crash_at, using, self.pacer)
        self.using = using

    def run(self, now: dt.datetime | None = None) -> RotationReport:
        """Rotate once; raises ``MaintenanceBusy`` at once if another run holds the lock."""
        now = now or timezone.now()
        report = RotationReport()
        with advisory_lock(PARTITION_MAINTENANCE_LOCK, self.using):
            for job in self.archiver.unfinished_jobs():
                if job.parent_table in self.tables:
                    self._archive(job, report)
            for parent, column in self.tables.items():
                maker = PartitionMaker(parent, column, self.policy, self.progress, self.using, self.pacer)
                made, moved = maker.ensure(now)
                report.created += made
                report.drained_rows += moved
            budget = self.policy.max_archives_per_run
            for parent in self.tables:
                for partition in expired(parent, now - self.policy.retention, self.using)[:budget]:
                    self._archive(self.archiver.job_for(partition), report)
            for parent, column in self.tables.items():
                state = catalog.default_state(parent, column, self.using)
                if state is not None:
                    report.default_rows[parent] = state.rows
                    if state.rows:
                        logger.warning("%s holds %d row(s) (%s .. %s)", state.name, state.rows,
                                       state.oldest, state.newest)
        return report

    def _archive(self, job, report: RotationReport) -> None:
        job = self.archiver.archive(job)
        if job.step == ArchivalStep.DROPPED:
            report.archived.append(job.partition)
        else:
            report.failed.append(f"{job.partition}: {job.error}")

    def archive_one(self, name: str) -> object:
        """Archive the attached partition ``name`` now, whatever its age (operator command)."""
        with advisory_lock(PARTITION_MAINTENANCE_LOCK, self.using):
            attached = catalog.attachment(name, self.using)
            if attached is None:
                job = next((j for j in self.archiver.unfinished_jobs() if j.partition == name), None)
                if job is None:
                    raise LookupError(f"no partition named {name} is attached to a partitioned table")
                return self.archiver.archive(job)
            parent, _ = attached
            if parent not in self.tables:
                raise LookupError(f"{name} belongs to {parent}, which is not a managed partitioned table")
            info = next(p for p in catalog.list_partitions(parent, self.using) if p.name == name)
            if info.is_default:
                raise LookupError(f"{name} is the DEFAULT partition of {parent}; it is drained, never archived")
            return self.archiver.archive(self.archiver.job_for(info))
