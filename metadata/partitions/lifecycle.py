"""Partition lifecycle: make partitions ahead, drain the DEFAULT partition, archive expired ones.

``PartitionRotation.plan()`` works out one rotation as a ``RotationPlan`` (``metadata.partitions.plan``)
and changes nothing; ``run()`` makes that plan and applies it, which is what the beat job and
``partitions rotate`` do, and ``partitions rotate --dry-run`` only prints it. A rotation finishes
tables an earlier run left half-drained and resumes unfinished archival jobs, makes every missing
partition from the current bin to ``premake`` bins ahead (and one for every bin that has rows
stranded in the DEFAULT partition; ``metadata.partitions.maker``), then archives partitions past
retention (through the registered archiver). Ranges come from the catalog's bounds, never names.
It is idempotent and safe to run as often as wanted: it holds an advisory lock (runs never
overlap). ``make_ahead()`` is the first part alone (current and premade bins), run by ``migrate``.

The archiver is not imported: ``metadata.archival`` is built on this package, so the rotation
builds whatever archiver the app registered (``metadata.partitions.archiving``; at start-up
``MetadataConfig.ready`` registers ``metadata.archival.PartitionArchiver``).
"""
from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.db import DEFAULT_DB_ALIAS
from django.utils import timezone

from metadata.models import PARTITIONED_TABLES, ArchivalStep, PartitionArchivalJob
from metadata.partitions import catalog
from metadata.partitions.archiving import Archiver, make_archiver
from metadata.partitions.bounds import TimeRange, bin_start, bins, partition_name, uncovered
from metadata.partitions.errors import PartitionLookupError
from metadata.partitions.locks import PARTITION_MAINTENANCE_LOCK, advisory_lock
from metadata.partitions.maker import PartitionMaker
from metadata.partitions.pacing import Pacer
from metadata.partitions.plan import PartitionArchival, PartitionCreation, RotationPlan, RotationReport
from metadata.partitions.policy import PartitionPolicy

__all__ = ["PartitionMaker", "PartitionPolicy", "PartitionRotation", "RotationPlan", "RotationReport"]

logger = logging.getLogger(__name__)
NEW_JOB_STEPS = (ArchivalStep.DETACHED, ArchivalStep.EXPORTED, ArchivalStep.VERIFIED, ArchivalStep.DROPPED)


class PartitionRotation:
    """Plan and apply maintenance over every partitioned table (or ``tables``), one run at a time."""

    def __init__(
        self,
        policy: PartitionPolicy | None = None,
        tables: dict[str, str] | None = None,
        archive_dir: Path | None = None,
        progress: Callable[[str], None] | None = None,
        crash_at: Any = None,
        using: str = DEFAULT_DB_ALIAS,
        pacer: Pacer | None = None,
    ) -> None:
        """``crash_at`` goes to the archiver untouched (``metadata.archival.CrashPoint``; tests only)."""
        self.policy = policy or PartitionPolicy.from_settings()
        self.tables = dict(PARTITIONED_TABLES if tables is None else tables)
        self.progress = progress or logger.info
        self.pacer = pacer or Pacer()
        self.archiver: Archiver = make_archiver(archive_dir, self.progress, crash_at, using, self.pacer)
        self.using = using

    # ------------------------------------------------------------------ plans
    def plan(self, now: dt.datetime | None = None) -> RotationPlan:
        """The whole rotation as of ``now``: read from the catalog and the jobs, nothing changed."""
        now = now or timezone.now()
        creations = [c for parent, column in self.tables.items() for c in self._creations(parent, column, now)]
        return self._plan(now, creations, self._archivals(now, creations))

    def plan_make_ahead(self, now: dt.datetime | None = None) -> RotationPlan:
        """Only the partitions of the current bin and ``premake`` bins ahead; no archival."""
        now = now or timezone.now()
        creations = [c for parent, column in self.tables.items()
                     for c in self._creations(parent, column, now, ahead_only=True)]
        return self._plan(now, creations, [])

    def run(self, now: dt.datetime | None = None) -> RotationReport:
        """Plan the rotation and apply the plan; ``MaintenanceLockBusy`` at once if another run holds the lock."""
        plan = self.plan(now)
        self.progress(f"plan: {plan.summary()}")
        return plan.apply()

    def make_ahead(self, now: dt.datetime | None = None) -> RotationReport:
        """Make the current and premade partitions now (``migrate`` runs this on a new database)."""
        return self.plan_make_ahead(now).apply()

    def _plan(self, now: dt.datetime, creations: list[PartitionCreation],
              archivals: list[PartitionArchival]) -> RotationPlan:
        default_rows = {}
        for parent, column in self.tables.items():
            state = catalog.default_state(parent, column, self.using)
            if state is not None:
                default_rows[parent] = state.rows
        makers = {parent: PartitionMaker(parent, column, self.policy, self.progress, self.using, self.pacer)
                  for parent, column in self.tables.items()}
        return RotationPlan(now=now, policy=self.policy, tables=self.tables, creations=creations,
                            archivals=archivals, default_rows=default_rows, makers=makers, archiver=self.archiver,
                            progress=self.progress, using=self.using)

    def _creations(self, parent: str, column: str, now: dt.datetime,
                   ahead_only: bool = False) -> list[PartitionCreation]:
        """Half-drained tables to finish, then a partition for every missing range (``_missing``),
        each with the DEFAULT rows it will take in."""
        staging = catalog.staging_tables(parent, self.using)
        finish = [] if ahead_only else staging
        gaps = self._missing(parent, column, now, [b for _, b in staging], ahead_only)
        rows = catalog.default_rows_in(parent, column, [b for _, b in finish] + gaps, self.using)
        planned = [PartitionCreation(parent, name, bounds, count, half_drained=True)
                   for (name, bounds), count in zip(finish, rows[: len(finish)], strict=True)]
        for bounds, count in zip(gaps, rows[len(finish):], strict=True):
            name = catalog.free_name(partition_name(parent, bounds), self.using)
            planned.append(PartitionCreation(parent, name, bounds, count))
        return planned

    def _missing(self, parent: str, column: str, now: dt.datetime, staging: list[TimeRange],
                 ahead_only: bool) -> list[TimeRange]:
        """From the bin holding ``now`` to ``premake`` bins ahead and (unless ``ahead_only``) every
        bin with rows in DEFAULT: the parts no partition or staging table covers (bounds, not names)."""
        interval = self.policy.interval
        current = bin_start(now, interval)
        wanted = list(bins(current, current + interval * (self.policy.premake + 1), interval))
        if not ahead_only:
            stranded = catalog.default_bins(parent, column, interval, self.policy.max_default_bins, self.using)
            wanted += [bounds for bounds, _ in stranded]
        taken = [p.bounds for p in catalog.range_partitions(parent, self.using)] + staging
        return sorted({gap for bounds in wanted for gap in uncovered(bounds, taken)})

    def _archivals(self, now: dt.datetime, creations: list[PartitionCreation]) -> list[PartitionArchival]:
        """Unfinished jobs to resume, then partitions past retention (those this plan makes included),
        oldest first, at most ``max_archives_per_run`` per table."""
        jobs = [job for job in self.archiver.unfinished_jobs() if job.parent_table in self.tables]
        planned = [_resumed(job, self.archiver.remaining_steps(job)) for job in jobs]
        busy = {(job.parent_table, job.partition) for job in jobs}
        cutoff = now - self.policy.retention
        for parent in self.tables:
            due = [PartitionArchival(parent, p.name, p.bounds, p.estimated_rows, NEW_JOB_STEPS)
                   for p in catalog.expired_partitions(parent, cutoff, self.using)]
            due += [PartitionArchival(parent, c.name, c.bounds, c.default_rows, NEW_JOB_STEPS)
                    for c in creations if c.parent == parent and c.bounds.end <= cutoff]
            due = [a for a in sorted(due, key=lambda a: a.bounds) if (parent, a.name) not in busy]
            planned += due[: self.policy.max_archives_per_run]
        return planned

    # ------------------------------------------------------------------ one partition
    def archive_one(self, name: str) -> PartitionArchivalJob:
        """Archive the attached partition ``name`` now, whatever its age (operator command)."""
        with advisory_lock(PARTITION_MAINTENANCE_LOCK, self.using):
            attached = catalog.attachment(name, self.using)
            if attached is None:
                job = next((j for j in self.archiver.unfinished_jobs() if j.partition == name), None)
                if job is None:
                    raise PartitionLookupError(f"no partition named {name} is attached to a partitioned table")
                return self.archiver.archive(job)
            parent, _ = attached
            if parent not in self.tables:
                raise PartitionLookupError(f"{name} belongs to {parent}, which is not a managed partitioned table")
            info = next(p for p in catalog.list_partitions(parent, self.using) if p.name == name)
            if info.is_default:
                raise PartitionLookupError(
                    f"{name} is the DEFAULT partition of {parent}; it is drained, never archived"
                )
            return self.archiver.archive(self.archiver.job_for(info))


def _resumed(job: PartitionArchivalJob, steps: tuple[str, ...]) -> PartitionArchival:
    after = f"failing at {job.failed_step}" if job.step == ArchivalStep.FAILED else str(job.step)
    return PartitionArchival(job.parent_table, job.partition, TimeRange(job.range_start, job.range_end),
                             job.row_count, steps, job_id=job.pk, resumed_after=after)
