"""Archive one partition: detach, export, verify, drop; each step recorded, each resumable.

A ``PartitionArchivalJob`` row says which step was last completed. Every step first looks at
the database and the disk, so it is safe to rerun after a crash at any point (before or after the
job row was updated): detaching an already detached table, re-exporting over a ``.part`` file,
re-verifying and dropping a table that is gone are all no-ops or repeats. Nothing is dropped
before the archive re-imported into a scratch table gives the table's row count and checksum.

DETACH: ``CONCURRENTLY`` is refused inside a transaction and while the parent has a DEFAULT
partition, which ours always have (so that a row with an unexpected timestamp is kept, not
refused). So we detach CONCURRENTLY only where no DEFAULT exists, and otherwise plainly, under
``lock_timeout`` with retries: the catalog change is instant once the lock is held, and a writer
waits at most one ``lock_timeout`` per attempt. An interrupted CONCURRENTLY detach is finished
with ``DETACH ... FINALIZE``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.utils import timezone

from metadata.archival import files
from metadata.archival.errors import ArchivalError, ArchiveIntegrityError
from metadata.conf import conf
from metadata.models import LIVE_STATUSES, PARTITIONED_TABLES, ArchivalStep, PartitionArchivalJob, Session
from metadata.partitions import catalog
from metadata.partitions.checksum import table_checksum
from metadata.partitions.locks import (
    autocommit_with_lock_retries,
    quote,
    with_lock_retries,
)
from metadata.partitions.pacing import Pacer

logger = logging.getLogger(__name__)

STEP_ORDER = [ArchivalStep.PENDING, ArchivalStep.DETACHED, ArchivalStep.EXPORTED, ArchivalStep.VERIFIED,
              ArchivalStep.DROPPED]
UNFINISHED = [ArchivalStep.PENDING, ArchivalStep.DETACHED, ArchivalStep.EXPORTED, ArchivalStep.VERIFIED,
              ArchivalStep.FAILED]


class InjectedCrash(BaseException):
    """Raised by a test's crash point. A BaseException, like a killed process, so the
    archiver does not record it as a failure: the next run must cope with a job left mid-step."""


@dataclass(frozen=True)
class CrashPoint:
    """Crash when reaching ``step``: after its action, before (or after) the job row records it."""

    step: str
    after_record: bool = False


def resume_step(job: PartitionArchivalJob) -> str:
    """The last step known complete: a failed job resumes from the step before the one that failed."""
    if job.step != ArchivalStep.FAILED:
        return job.step
    failed = job.failed_step or ArchivalStep.DETACHED
    if failed == ArchivalStep.VERIFIED:
        return ArchivalStep.DETACHED  # a bad archive is written again from the table, still there
    return STEP_ORDER[max(STEP_ORDER.index(failed) - 1, 0)]


class PartitionArchiver:
    """Move partitions to cold storage under ``archive_dir``, one recorded step at a time."""

    def __init__(
        self,
        archive_dir: Path | None = None,
        progress: Callable[[str], None] | None = None,
        crash_at: CrashPoint | None = None,
        using: str = DEFAULT_DB_ALIAS,
        pacer: Pacer | None = None,
    ) -> None:
        self.archive_dir = Path(archive_dir or conf.ARCHIVE_DIR)
        self.progress = progress or logger.info
        self.crash_at = crash_at
        self.using = using
        self.pacer = pacer or Pacer()

    # ------------------------------------------------------------------ jobs
    def job_for(self, partition: catalog.PartitionInfo) -> PartitionArchivalJob:
        """The unfinished job for ``partition``, or a new pending one."""
        job = (
            PartitionArchivalJob.objects.using(self.using)
            .filter(parent_table=partition.parent, partition=partition.name, step__in=UNFINISHED)
            .first()
        )
        if job is not None:
            return job
        return PartitionArchivalJob.objects.using(self.using).create(
            parent_table=partition.parent,
            partition=partition.name,
            relation_oid=catalog.relation_oid(partition.name, self.using),
            range_start=partition.bounds.start,
            range_end=partition.bounds.end,
        )

    def unfinished_jobs(self) -> list[PartitionArchivalJob]:
        jobs = PartitionArchivalJob.objects.using(self.using).filter(step__in=UNFINISHED)
        return list(jobs.order_by("range_start", "id"))

    def unfinished_job(self, pk: int) -> PartitionArchivalJob | None:
        """Job ``pk`` if it is still unfinished (a plan made earlier may name one finished since)."""
        return PartitionArchivalJob.objects.using(self.using).filter(pk=pk, step__in=UNFINISHED).first()

    @staticmethod
    def remaining_steps(job: PartitionArchivalJob) -> tuple[str, ...]:
        """The steps ``archive(job)`` would run, in order (empty once dropped)."""
        done = STEP_ORDER.index(resume_step(job))
        return tuple(STEP_ORDER[done + 1:])

    def archive(self, job: PartitionArchivalJob) -> PartitionArchivalJob:
        """Run the job's remaining steps; on error record ``failed`` (and why) and return."""
        steps = [
            (ArchivalStep.DETACHED, self._detach),
            (ArchivalStep.EXPORTED, self._export),
            (ArchivalStep.VERIFIED, self._verify),
            (ArchivalStep.DROPPED, self._drop),
        ]
        done = STEP_ORDER.index(resume_step(job))
        for number, (step, action) in enumerate(steps, start=1):
            if STEP_ORDER.index(step) <= done:
                continue
            try:
                changes = action(job) or {}
            except Exception as exc:  # recorded on the job; the next run resumes from it
                self._record_failure(job, step, exc)
                return job
            self._maybe_crash(step, after_record=False)
            self._record(job, step, **changes)
            self.progress(f"{job.partition}: {step} ({number}/{len(steps)})")
            self._maybe_crash(step, after_record=True)
            self.pacer.pause()
        return job

    def _maybe_crash(self, step: str, after_record: bool) -> None:
        if self.crash_at and self.crash_at.step == step and self.crash_at.after_record == after_record:
            raise InjectedCrash(f"injected crash at {step} ({'after' if after_record else 'before'} recording)")

    def _record(self, job: PartitionArchivalJob, step: str, **changes) -> None:
        now = timezone.now()
        changes.update(step=step, updated_at=now, error="", failed_step="")
        if step == ArchivalStep.DROPPED:
            changes["finished_at"] = now
        PartitionArchivalJob.objects.using(self.using).filter(pk=job.pk).update(**changes)
        for field, value in changes.items():
            setattr(job, field, value)

    def _record_failure(self, job: PartitionArchivalJob, step: str, exc: Exception) -> None:
        message = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")[:2000]
        logger.warning("archival of %s failed at %s: %s", job.partition, step, message)
        changes = dict(step=ArchivalStep.FAILED, failed_step=step, error=message, updated_at=timezone.now(),
                       attempts=job.attempts + 1)
        PartitionArchivalJob.objects.using(self.using).filter(pk=job.pk).update(**changes)
        for field, value in changes.items():
            setattr(job, field, value)

    # ------------------------------------------------------------------ steps
    def _columns(self, job: PartitionArchivalJob) -> list[str]:
        return catalog.table_columns(job.parent_table, self.using)

    def _is_ours(self, job: PartitionArchivalJob) -> bool:
        """Does ``job.partition`` still name the very table the job was made for?"""
        oid = catalog.relation_oid(job.partition, self.using)
        return oid is not None and (job.relation_oid is None or oid == job.relation_oid)

    def _detach(self, job: PartitionArchivalJob) -> None:
        if not self._is_ours(job):
            raise ArchivalError(f"table {job.partition} (oid {job.relation_oid}) no longer exists")
        attached = catalog.attachment(job.partition, self.using)
        if attached is None:
            return  # detached by an earlier run that crashed before recording it
        parent, pending = attached
        if parent != job.parent_table:
            raise ArchivalError(f"{job.partition} is attached to {parent}, not {job.parent_table}")
        info = next(p for p in catalog.list_partitions(parent, self.using) if p.name == job.partition)
        if info.bounds is None or (info.bounds.start, info.bounds.end) != (job.range_start, job.range_end):
            raise ArchivalError(
                f"{job.partition} has bounds {info.bounds}, not the job's [{job.range_start}, {job.range_end})"
            )
        self._refuse_live_sessions(job)
        detach = f"ALTER TABLE {quote(parent)} DETACH PARTITION {quote(job.partition)}"
        if pending:
            autocommit_with_lock_retries(f"{detach} FINALIZE", f"finalize detach of {job.partition}", self.using)
        elif catalog.default_partition(parent, self.using) is None and not connections[self.using].in_atomic_block:
            autocommit_with_lock_retries(f"{detach} CONCURRENTLY", f"detach {job.partition}", self.using)
        else:
            with_lock_retries(lambda: _execute(detach, self.using), f"detach {job.partition}", self.using)

    def _refuse_live_sessions(self, job: PartitionArchivalJob) -> None:
        """A sessions partition is archived only once none of its sessions is queued or running:
        their worker would write to a session that is gone. The job fails and the next run retries."""
        if job.parent_table != Session._meta.db_table:
            return
        with connections[self.using].cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {quote(job.partition)} WHERE status = ANY(%s)",
                           [[str(s) for s in LIVE_STATUSES]])
            live = cursor.fetchone()[0]
        if live:
            raise ArchivalError(f"{job.partition} still has {live} live session(s); it is archived once they end")

    def _export(self, job: PartitionArchivalJob) -> dict:
        if not self._is_ours(job) or catalog.attachment(job.partition, self.using) is not None:
            raise ArchivalError(f"{job.partition} is not the detached table this job made")
        columns = self._columns(job)
        target = files.archive_path(self.archive_dir, job.parent_table, job.partition, job.pk)
        outermost = not connections[self.using].in_atomic_block
        with transaction.atomic(using=self.using):
            if outermost:  # one snapshot for the checksum and the COPY
                _execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ", self.using)
            count, checksum = table_checksum(job.partition, columns, self.using)
            exported = files.export_table(job.partition, columns, target, self.progress, self.using,
                                          self.pacer.tick)
        if exported != count:
            raise ArchiveIntegrityError(f"COPY wrote {exported} rows but the table holds {count}")
        sha256 = files.file_sha256(target)
        manifest = files.ArchiveManifest(
            parent_table=job.parent_table,
            partition=job.partition,
            partition_column=PARTITIONED_TABLES.get(job.parent_table, ""),
            range_start=job.range_start.isoformat(),
            range_end=job.range_end.isoformat(),
            columns=columns,
            row_count=count,
            checksum=checksum,
            file_sha256=sha256,
            file_bytes=target.stat().st_size,
            job_id=job.pk,
            exported_at=timezone.now().isoformat(),
        )
        manifest.write(files.manifest_path(target))
        return dict(archive_path=str(target), row_count=count, checksum=checksum,
                    archive_sha256=sha256, archive_bytes=manifest.file_bytes)

    def _verify(self, job: PartitionArchivalJob) -> None:
        target = Path(job.archive_path)
        if not target.exists():
            raise ArchiveIntegrityError(f"archive {target} is missing")
        if files.file_sha256(target) != job.archive_sha256:
            raise ArchiveIntegrityError(f"archive {target} changed since it was written (sha256 differs)")
        manifest = files.ArchiveManifest.read(files.manifest_path(target))
        if not self._is_ours(job):
            raise ArchivalError(f"table {job.partition} (oid {job.relation_oid}) vanished before verification")
        # The recorded figures are the table's, taken in the COPY's own snapshot; the detached
        # table has no writers, so the archive is compared with them, not with a third scan.
        with transaction.atomic(using=self.using):
            archived = files.checksum_of_archive(target, job.parent_table, manifest.columns, self.progress,
                                                 self.using, self.pacer.tick)
        recorded = (job.row_count, job.checksum)
        if archived != recorded or (manifest.row_count, manifest.checksum) != recorded:
            raise ArchiveIntegrityError(f"checksums differ: table {recorded}, archive {archived}")

    def _drop(self, job: PartitionArchivalJob) -> None:
        if not self._is_ours(job):
            return  # dropped by an earlier run that crashed before recording it
        if catalog.attachment(job.partition, self.using) is not None:
            raise ArchivalError(f"{job.partition} is attached again; refusing to drop it")
        with_lock_retries(
            lambda: _execute(f"DROP TABLE IF EXISTS {quote(job.partition)}", self.using),
            f"drop {job.partition}",
            self.using,
        )


def _execute(statement: str, using: str = DEFAULT_DB_ALIAS) -> None:
    with connections[using].cursor() as cursor:
        cursor.execute(statement)

