"""Execute one maintenance run in a worker: claim it, run its action, write progress and outcome.

The actions are the existing code, not new versions of it: ``PartitionRotation`` (plan, then
``apply()``), ``PartitionRotation.archive_one`` and ``restore_archive``; each holds the
maintenance advisory lock (the restore is wrapped in it here), so a run never overlaps another
run or the beat job's rotation. A run that finds the lock held has done nothing and ends
``skipped``, saying so.

Progress: the maintenance code reports one line at a time through its ``progress`` callback;
``RunProgress`` writes each line to the run's row and counts the steps it recognises (a
partition attached, an archival step) against the total the action announced (for a rotation,
from its plan: one per partition made, one per archival step).

Redelivery: the task is acknowledged late, so a worker that died mid-run has the run delivered
again. The actions are resumable (archival jobs record their steps, a half-drained partition is
finished), so the run is executed again; a finished run is not. A redelivered run that finds the
lock held is still being run by its first delivery, and is left to it.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import asdict

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models.functions import Coalesce
from django.utils import timezone

from metadata.archival.errors import ArchivalError
from metadata.archival.families import ArchivedDay, day_of, restore_day
from metadata.maintenance.requests import FINISHED
from metadata.models import ArchivalStep, MaintenanceAction, MaintenanceRun, MaintenanceRunStatus, PartitionArchivalJob
from metadata.partitions import MaintenanceLockBusy, PartitionRotation, TimeRange, catalog
from metadata.partitions.locks import PARTITION_MAINTENANCE_LOCK, advisory_lock

logger = logging.getLogger(__name__)
DB = DEFAULT_DB_ALIAS

# Lines of the maintenance code that mark a step done (metadata.partitions.maker, archival.archiver,
# partitions.plan, archival.restore).
ATTACHED = re.compile(r"^\S+: attached ")
ARCHIVAL_STEP = re.compile(r"^\S+: (detached|exported|verified|dropped) \((\d+)/\d+\)$")
SKIPPED_ARCHIVAL = re.compile(r"^(\S+): archived or gone since the plan was made; skipped$")
RESTORED = re.compile(r"^\S+: \d+ row\(s\) restored, checksum verified$")
LINE_CHARS = 500
PROGRESS_SQL = (f"UPDATE {MaintenanceRun._meta.db_table} "
                "SET progress_done = %s, progress_total = %s, progress_line = %s, updated_at = %s WHERE id = %s")

Outcome = tuple[dict, str]  # (the run's outcome, an error: empty when it succeeded)


class RunProgress:
    """The ``progress`` callback of one run: each line goes to its row, with steps done of the total.

    Written on a connection of its own, in autocommit: the maintenance code reports from inside
    its own transactions too (an export's COPY, a restore), and the page must see those lines as
    they come, not when (or unless) that transaction commits. ``close()`` when the run ends.
    """

    def __init__(self, run: MaintenanceRun, steps: Callable[[str, int], int]) -> None:
        self.run_id = run.pk
        self.steps = steps  # (line, steps done so far) -> steps done after it
        self.done = 0
        self.total = 0
        self._connection = None
        # Run inside a caller's transaction (an eager task in a test), a second connection would
        # wait forever on the row lock that transaction holds on the run: write in it instead.
        self._separate = not connections[DB].in_atomic_block

    def start(self, total: int, line: str) -> None:
        self.total = total
        self._write(line)

    def __call__(self, line: str) -> None:
        self.done = min(self.steps(line, self.done), self.total)
        self._write(line)

    def finish(self) -> None:
        """Every step done (some were not reported as lines: a range another run made meanwhile)."""
        self.done = self.total

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _write(self, line: str) -> None:
        logger.info("maintenance run %s: %s", self.run_id, line)
        if self._separate and self._connection is None:
            self._connection = connections.create_connection(DB)  # not the thread's: outside its transactions
        with (self._connection or connections[DB]).cursor() as cursor:
            cursor.execute(PROGRESS_SQL, [self.done, self.total, line[:LINE_CHARS], timezone.now(), self.run_id])


# ---------------------------------------------------------------------- actions
def rotate(run: MaintenanceRun, progress: RunProgress) -> Outcome:
    """The rotation the Partitions page shows as its plan, made afresh here and applied."""
    plan = PartitionRotation(progress=progress).plan()
    steps_of = {a.name: len(a.steps) for a in plan.archivals}

    def steps(line: str, done: int) -> int:
        skipped = SKIPPED_ARCHIVAL.match(line)
        if skipped:
            return done + steps_of.get(skipped.group(1), 1)
        return done + 1 if ATTACHED.match(line) or ARCHIVAL_STEP.match(line) else done

    progress.steps = steps
    progress.start(len(plan.creations) + sum(steps_of.values()), f"plan: {plan.summary()}")
    report = plan.apply()
    outcome = {"plan": plan.summary(), "summary": report.summary(), **asdict(report)}
    error = f"{len(report.failed)} archival job(s) failed; first: {report.failed[0]}" if report.failed else ""
    return outcome, error


def archive(run: MaintenanceRun, progress: RunProgress) -> Outcome:
    """Archive the partition ``run.target``: detach, export, verify, drop (its job resumes if it had one)."""
    progress.steps = lambda line, done: int(m.group(2)) if (m := ARCHIVAL_STEP.match(line)) else done
    progress.start(4, f"{run.target}: archiving (detach, export, verify, drop)")
    job = PartitionRotation(progress=progress).archive_one(run.target)
    MaintenanceRun.objects.using(DB).filter(pk=run.pk).update(archival_job_id=job.pk)
    outcome = {"job": job.pk, "step": job.step, "rows": job.row_count, "archive": job.archive_path,
               "checksum": job.checksum}
    if job.step != ArchivalStep.DROPPED:
        outcome["summary"] = f"{run.target}: failed at {job.failed_step} (run again to resume)"
        return outcome, f"{run.target} failed at {job.failed_step}: {job.error}"
    outcome["summary"] = f"{job.row_count} row(s) of {run.target} archived to {job.archive_path}"
    return outcome, ""


def restore(run: MaintenanceRun, progress: RunProgress) -> Outcome:
    """Restore the archive of job ``run.archival_job_id``, verified, standalone or attached; a day
    of sessions comes back whole: the sessions with their tokens and candidates (``families``)."""
    job = PartitionArchivalJob.objects.using(DB).filter(pk=run.archival_job_id).first()
    if job is None or not job.archive_path:
        raise ArchivalError(f"archival job {run.archival_job_id} and its archive are gone")
    attach = bool(run.options.get("attach"))
    day = day_of(job, DB) or ArchivedDay(TimeRange(job.range_start, job.range_end), {job.parent_table: job})
    # A sibling whose table exists again was restored already (the requested one was checked).
    jobs = [j for j in day.ordered_jobs() if j.pk == job.pk or not catalog.relation_exists(j.partition, DB)]
    progress.steps = lambda line, done: done + 1 if RESTORED.match(line) or ATTACHED.match(line) else done
    progress.start(len(jobs) * (2 + attach), f"{job.partition}: restoring {len(jobs)} archive(s) of its day")
    with advisory_lock(PARTITION_MAINTENANCE_LOCK, DB):
        results = restore_day(ArchivedDay(day.bounds, {j.parent_table: j for j in jobs}), attach=attach,
                              progress=progress, using=DB)
    one = len(results) == 1
    where = ("attached to its parent" if one else "attached to their parents") if attach else (
        "as a standalone table" if one else "as standalone tables")
    rows = sum(r.rows for r in results)
    return {"tables": [r.table for r in results], "table": results[0].table, "rows": rows,
            "checksums": {r.table: r.checksum for r in results}, "attached": attach,
            "summary": f"{rows} row(s) restored into {', '.join(r.table for r in results)} {where}"}, ""


ACTIONS: dict[str, Callable[[MaintenanceRun, RunProgress], Outcome]] = {
    MaintenanceAction.ROTATE: rotate,
    MaintenanceAction.ARCHIVE: archive,
    MaintenanceAction.RESTORE: restore,
}


# ---------------------------------------------------------------------- one run
def execute_run(run_id: int, task_id: str = "") -> dict:
    """Run maintenance run ``run_id`` to its end; return its outcome (the Celery task's result)."""
    run = MaintenanceRun.objects.using(DB).filter(pk=run_id).first()
    if run is None:
        logger.warning("maintenance run %s does not exist; nothing to do", run_id)
        return {"missing": run_id}
    if run.status in FINISHED:
        return {"status": run.status, **run.outcome}  # a redelivery of a run that ended
    redelivered = run.status == MaintenanceRunStatus.RUNNING
    now = timezone.now()
    MaintenanceRun.objects.using(DB).filter(pk=run.pk).update(
        status=MaintenanceRunStatus.RUNNING, started_at=Coalesce("started_at", now), updated_at=now,
        task_id=task_id or run.task_id)
    progress = RunProgress(run, lambda line, done: done)
    try:
        outcome, error = ACTIONS[run.action](run, progress)
    except MaintenanceLockBusy as exc:
        if redelivered:  # the first delivery holds the lock and is still running it
            logger.info("maintenance run %s redelivered while it runs elsewhere; left to it", run.pk)
            return {"status": MaintenanceRunStatus.RUNNING, "redelivered": True}
        message = f"skipped, nothing done: {exc}"
        return _finish(run, MaintenanceRunStatus.SKIPPED, {"summary": message}, message,
                       progress_done=0, progress_line=message)
    except Exception as exc:  # recorded on the run; the actions themselves are resumable
        logger.exception("maintenance run %s (%s) failed", run.pk, run.action)
        message = " ".join(f"{type(exc).__name__}: {exc}".split())[:2000]
        return _finish(run, MaintenanceRunStatus.FAILED, {"summary": message}, message)
    finally:
        progress.close()
    if error:
        return _finish(run, MaintenanceRunStatus.FAILED, outcome, error)
    progress.finish()
    return _finish(run, MaintenanceRunStatus.SUCCEEDED, outcome, "", progress_done=progress.done)


def _finish(run: MaintenanceRun, status: str, outcome: dict, error: str, **changes) -> dict:
    now = timezone.now()
    MaintenanceRun.objects.using(DB).filter(pk=run.pk).update(
        status=status, outcome=outcome, error=error, finished_at=now, updated_at=now, **changes)
    logger.info("maintenance run %s %s: %s", run.pk, status, outcome.get("summary", ""))
    return {"status": status, **outcome}
