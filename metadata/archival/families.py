"""Sessions with their tokens and candidates: one unit to archive, find and restore.

Tokens and candidates are partitioned on their session's creation time, with the same bounds as
the sessions table, so one day's sessions and all their rows lie in three partitions of the same
range. The rotation archives the three together (the same retention makes them due in the same
run); this module groups their archival jobs back into one ``ArchivedDay``, restores a day as a
whole, and tells the API that a session id belongs to an archived day (410 Gone, not 404).
"""
from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from django.db import DEFAULT_DB_ALIAS

from metadata.archival.restore import RestoreResult, restore_archive
from metadata.ids import created_at_of
from metadata.models import ArchivalStep, Candidate, PartitionArchivalJob, Session, TokenRecord
from metadata.partitions import catalog
from metadata.partitions.bounds import TimeRange

SESSIONS = Session._meta.db_table
SESSION_FAMILY: tuple[str, ...] = (SESSIONS, TokenRecord._meta.db_table, Candidate._meta.db_table)


@dataclass
class ArchivedDay:
    """One range of the session family and the finished archival job of each of its tables."""

    bounds: TimeRange
    jobs: dict[str, PartitionArchivalJob] = field(default_factory=dict)  # table -> its latest finished job

    @property
    def complete(self) -> bool:
        """All three tables of the range are archived (a table with no partition then has no job)."""
        return SESSIONS in self.jobs

    @property
    def rows(self) -> int:
        return sum(job.row_count or 0 for job in self.jobs.values())

    def ordered_jobs(self) -> list[PartitionArchivalJob]:
        return [self.jobs[table] for table in SESSION_FAMILY if table in self.jobs]


def archived_days(jobs: Iterable[PartitionArchivalJob]) -> list[ArchivedDay]:
    """The finished jobs of the session family grouped by range, newest range first."""
    days: dict[tuple[dt.datetime, dt.datetime], ArchivedDay] = {}
    for job in sorted(jobs, key=lambda j: (j.finished_at or j.updated_at, j.pk)):
        if job.parent_table not in SESSION_FAMILY or job.step != ArchivalStep.DROPPED or not job.archive_path:
            continue
        key = (job.range_start, job.range_end)
        day = days.setdefault(key, ArchivedDay(TimeRange(*key)))
        day.jobs[job.parent_table] = job  # the latest one wins (a range archived, restored, archived again)
    return sorted(days.values(), key=lambda d: d.bounds.start, reverse=True)


def day_of(job: PartitionArchivalJob, using: str = DEFAULT_DB_ALIAS) -> ArchivedDay | None:
    """The archived day ``job`` belongs to, with its siblings' jobs; None if it is not of the family."""
    if job.parent_table not in SESSION_FAMILY:
        return None
    siblings = PartitionArchivalJob.objects.using(using).filter(
        parent_table__in=SESSION_FAMILY, range_start=job.range_start, range_end=job.range_end,
        step=ArchivalStep.DROPPED).exclude(archive_path="")
    days = archived_days(siblings)
    return days[0] if days else None


def restore_day(day: ArchivedDay, attach: bool = False, skip: Callable[[PartitionArchivalJob], bool] | None = None,
                progress: Callable[[str], None] | None = None,
                using: str = DEFAULT_DB_ALIAS) -> list[RestoreResult]:
    """Restore every archive of ``day`` (sessions first), each verified by its checksum.

    ``skip(job)`` leaves out a table restored already. Each archive is restored in its own
    transaction, so a damaged one stops the day there and leaves the ones before it restored
    (the rerun skips them).
    """
    results = []
    for job in day.ordered_jobs():
        if skip is not None and skip(job):
            continue
        results.append(restore_archive(Path(job.archive_path), attach=attach, progress=progress, using=using))
    return results


def archived_session_job(session_id: uuid.UUID | str, using: str = DEFAULT_DB_ALIAS) -> PartitionArchivalJob | None:
    """The archival job of the sessions partition that held ``session_id``, if that day is archived
    and not attached again; None for a day still in the database, and for an id that carries no
    time (a version-4 id: which day held it is not known without the archives)."""
    when = created_at_of(session_id)
    if when is None or catalog.partition_covering(SESSIONS, when, using) is not None:
        return None
    return (PartitionArchivalJob.objects.using(using)
            .filter(parent_table=SESSIONS, step=ArchivalStep.DROPPED, range_start__lte=when, range_end__gt=when)
            .order_by("-finished_at", "-pk").first())
