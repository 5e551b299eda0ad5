"""A rotation as a plan: what it would create, drain, archive and drop, printed before it is applied.

``PartitionRotation.plan()`` reads the catalog and the archival jobs and changes nothing;
``RotationPlan.describe()`` says in one line per step what applying it would do (``partitions
rotate --dry-run`` prints that), and ``RotationPlan.apply()`` does it under the maintenance
advisory lock. The beat job and ``partitions rotate`` apply the plan they have just made.

A plan may be applied later than it was made, after another run changed the catalog: each step
looks again under the lock. A range is made only where no partition covers it now, a partition
is archived only if a partition with those bounds is still attached, and a resumed archival job
only if it is still unfinished; whatever another run did in between is skipped, not redone.
"""
from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import DEFAULT_DB_ALIAS

from metadata.models import ArchivalStep
from metadata.partitions import catalog
from metadata.partitions.archiving import Archiver
from metadata.partitions.bounds import TimeRange
from metadata.partitions.locks import PARTITION_MAINTENANCE_LOCK, advisory_lock
from metadata.partitions.maker import PartitionMaker
from metadata.partitions.policy import PartitionPolicy

ARCHIVE_STEPS = (ArchivalStep.DETACHED, ArchivalStep.EXPORTED, ArchivalStep.VERIFIED)


@dataclass(frozen=True)
class PartitionCreation:
    """A range to make a partition for, and the DEFAULT rows it will take in before its ATTACH."""

    parent: str
    name: str  # the name it gets if nothing else takes it first (names are for people)
    bounds: TimeRange
    default_rows: int
    half_drained: bool = False  # a staging table an earlier run left: finished, not made


@dataclass(frozen=True)
class PartitionArchival:
    """A partition to move to cold storage: the archival steps left, ending with the drop."""

    parent: str
    name: str
    bounds: TimeRange
    estimated_rows: int | None  # the statistics' live tuples, or the job's exact count; None: unknown
    steps: tuple[str, ...]
    job_id: int | None = None  # an unfinished job this plan resumes; None for a new one
    resumed_after: str = ""  # the job's last completed step (or where it failed)


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


@dataclass
class RotationPlan:
    """One rotation's steps over every managed table, as of ``now``; ``apply()`` carries them out."""

    now: dt.datetime
    policy: PartitionPolicy
    tables: dict[str, str]
    creations: list[PartitionCreation]
    archivals: list[PartitionArchival]
    default_rows: dict[str, int]
    makers: dict[str, PartitionMaker] = field(repr=False, compare=False)
    archiver: Archiver = field(repr=False, compare=False)
    progress: Callable[[str], None] = field(repr=False, compare=False)
    using: str = field(default=DEFAULT_DB_ALIAS, repr=False, compare=False)

    # ------------------------------------------------------------------ describe
    @property
    def drained_rows(self) -> int:
        return sum(c.default_rows for c in self.creations)

    @property
    def is_empty(self) -> bool:
        return not self.creations and not self.archivals

    def summary(self) -> str:
        archives = sum(1 for a in self.archivals if set(a.steps) & set(ARCHIVE_STEPS))
        drops = sum(1 for a in self.archivals if ArchivalStep.DROPPED in a.steps)
        return (f"create {len(self.creations)} partition(s), drain {self.drained_rows} row(s) from DEFAULT, "
                f"archive {archives} partition(s), drop {drops}")

    def describe(self) -> list[str]:
        """One line per step, grouped by table, then the summary."""
        lines = [f"Rotation plan as of {_moment(self.now)} ({self.policy.describe()}); "
                 f"archives go to {self.archiver.archive_dir}"]
        for parent, column in self.tables.items():
            lines.append(f"{parent} (RANGE on {column}):")
            lines += self._table_lines(parent) or ["  nothing to do"]
        lines.append(self.summary())
        return lines

    def print(self, write: Callable[[str], None] = builtins.print) -> None:
        for line in self.describe():
            write(line)

    def _table_lines(self, parent: str) -> list[str]:
        lines = []
        for archival in self._archivals(parent, resumed=True):
            lines += self._archival_lines(archival)
        for creation in (c for c in self.creations if c.parent == parent):
            verb = "finish" if creation.half_drained else "create"
            note = " (half-drained by an earlier run)" if creation.half_drained else ""
            lines.append(f"  {verb:8} {creation.name:34} {_span(creation.bounds)}{note}")
            if creation.default_rows:
                lines.append(f"  {'drain':8} {creation.default_rows} row(s) from DEFAULT into {creation.name}")
        for archival in self._archivals(parent, resumed=False):
            lines += self._archival_lines(archival)
        rows = self.default_rows.get(parent)
        if rows:
            stays = rows - sum(c.default_rows for c in self.creations if c.parent == parent)
            lines.append(f"  {'DEFAULT':8} {rows} row(s) now; {stays} left after this plan")
        return lines

    def _archival_lines(self, archival: PartitionArchival) -> list[str]:
        lines = []
        resumed = f" (resumes job {archival.job_id} after {archival.resumed_after})" if archival.job_id else ""
        if set(archival.steps) & set(ARCHIVE_STEPS):
            rows = f"  ~{archival.estimated_rows} row(s)" if archival.estimated_rows is not None else ""
            lines.append(f"  {'archive':8} {archival.name:34} {_span(archival.bounds)}{rows}{resumed}")
            resumed = ""
        if ArchivalStep.DROPPED in archival.steps:
            lines.append(f"  {'drop':8} {archival.name} once its archive is verified{resumed}")
        return lines

    def _archivals(self, parent: str, resumed: bool) -> list[PartitionArchival]:
        return [a for a in self.archivals if a.parent == parent and (a.job_id is not None) == resumed]

    # ------------------------------------------------------------------ apply
    def apply(self) -> RotationReport:
        """Carry the plan out under the maintenance lock; ``MaintenanceLockBusy`` if another run holds it.

        Order as in every rotation: resume unfinished archival jobs, make partitions (draining
        DEFAULT into them), archive the expired ones; then record what DEFAULT still holds.
        """
        report = RotationReport()
        with advisory_lock(PARTITION_MAINTENANCE_LOCK, self.using):
            for archival in (a for a in self.archivals if a.job_id is not None):
                self._archive(archival, report)
            for creation in self.creations:
                self._create(creation, report)
            for archival in (a for a in self.archivals if a.job_id is None):
                self._archive(archival, report)
            for parent, column in self.tables.items():
                state = catalog.default_state(parent, column, self.using)
                if state is not None:
                    report.default_rows[parent] = state.rows
                    if state.rows:
                        self.progress(f"{state.name} holds {state.rows} row(s) ({state.oldest} .. {state.newest})")
        return report

    def _create(self, creation: PartitionCreation, report: RotationReport) -> None:
        maker = self.makers[creation.parent]
        if creation.half_drained:
            made, moved = maker.finish(creation.name, creation.bounds)
        else:
            made, moved = maker.make(creation.bounds)
        report.created += made
        report.drained_rows += moved

    def _archive(self, archival: PartitionArchival, report: RotationReport) -> None:
        if archival.job_id is not None:
            job = self.archiver.unfinished_job(archival.job_id)
        else:
            attached = next((p for p in catalog.range_partitions(archival.parent, self.using)
                             if p.bounds == archival.bounds), None)
            job = self.archiver.job_for(attached) if attached is not None else None
        if job is None:
            self.progress(f"{archival.name}: archived or gone since the plan was made; skipped")
            return
        job = self.archiver.archive(job)
        if job.step == ArchivalStep.DROPPED:
            report.archived.append(job.partition)
        else:
            report.failed.append(f"{job.partition}: {job.error}")


def _moment(moment: dt.datetime) -> str:
    return f"{moment.astimezone(dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


def _span(bounds: TimeRange) -> str:
    return f"{bounds.start:%Y-%m-%d %H:%M} .. {bounds.end:%Y-%m-%d %H:%M} UTC"
