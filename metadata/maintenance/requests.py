"""Check an operator's maintenance request, record it as a run and queue it; or refuse it.

Everything a worker would only find out later and half-way is checked here, before anything is
written: the partition exists, is attached to a managed table, is not the DEFAULT and ended
before the retention cutoff; the archive's job is finished, its file is on disk, and it was not
restored already. A refusal is a ``MaintenanceRefused`` whose message is the admin's; the run row
is written only for an accepted request.

Runs are queued by task name (``metadata.tasks.run_maintenance``), so this module does not import
the task module, which imports the runner.
"""
from __future__ import annotations

import datetime as dt
import logging
import re
import uuid
from pathlib import Path

from celery import current_app
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.utils import timezone

from metadata.models import (
    PARTITIONED_TABLES,
    ArchivalStep,
    MaintenanceAction,
    MaintenanceRun,
    MaintenanceRunStatus,
    PartitionArchivalJob,
)
from metadata.partitions import catalog
from metadata.partitions.beat_jobs import MAINTENANCE_QUEUE
from metadata.partitions.bounds import TimeRange
from metadata.partitions.catalog import PartitionInfo
from metadata.partitions.policy import PartitionPolicy

logger = logging.getLogger(__name__)

TASK_NAME = "metadata.tasks.run_maintenance"
QUEUE = MAINTENANCE_QUEUE  # where runs go (tests point it at a queue of their own)
ACTIVE = (MaintenanceRunStatus.QUEUED, MaintenanceRunStatus.RUNNING)
FINISHED = (MaintenanceRunStatus.SUCCEEDED, MaintenanceRunStatus.FAILED, MaintenanceRunStatus.SKIPPED)
TABLE_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
DB = DEFAULT_DB_ALIAS  # the primary: what the catalog says now, not what a replica replayed


class MaintenanceRefused(Exception):
    """The request cannot be run as asked; the message says why, for the operator."""


# ---------------------------------------------------------------------- checks
def archive_cutoff(policy: PartitionPolicy | None = None, now: dt.datetime | None = None) -> dt.datetime:
    """Partitions that end at or before this instant are past the retention and may be archived."""
    policy = policy or PartitionPolicy.from_settings()
    return (now or timezone.now()) - policy.retention


def archivable_partition(name: str, policy: PartitionPolicy | None = None,
                         now: dt.datetime | None = None) -> PartitionInfo:
    """The attached range partition ``name`` if it may be archived now, else ``MaintenanceRefused``."""
    name = (name or "").strip()
    if not TABLE_NAME.match(name):
        raise MaintenanceRefused(f"{name!r} is not a partition name (lower-case letters, digits and _)")
    attached = catalog.attachment(name, DB)
    if attached is None:
        raise MaintenanceRefused(f"no partition named {name} is attached to a partitioned table")
    parent, _ = attached
    if parent not in PARTITIONED_TABLES:
        raise MaintenanceRefused(f"{name} belongs to {parent}, which is not a managed partitioned table")
    info = next(p for p in catalog.list_partitions(parent, DB) if p.name == name)
    if info.is_default:
        raise MaintenanceRefused(f"{name} is the DEFAULT partition of {parent}: it is drained, never archived")
    policy = policy or PartitionPolicy.from_settings()
    cutoff = archive_cutoff(policy, now)
    if info.bounds.end > cutoff:
        raise MaintenanceRefused(
            f"{name} ends {info.bounds.end:%Y-%m-%d %H:%M} UTC, inside the retention ({policy.describe()}): "
            f"only partitions that ended by {cutoff:%Y-%m-%d %H:%M} UTC may be archived"
        )
    return info


def restored_job_ids(jobs: list[PartitionArchivalJob]) -> dict[int, str]:
    """Of ``jobs``, those already restored, each with why: a restore run succeeded, or a table
    with the partition's name exists again (restored by hand, or attached and not archived since)."""
    ids = [job.pk for job in jobs]
    restored = {}
    runs = (MaintenanceRun.objects.using(DB)
            .filter(action=MaintenanceAction.RESTORE, status=MaintenanceRunStatus.SUCCEEDED, archival_job_id__in=ids)
            .values_list("archival_job_id", "pk"))
    for job_id, run_id in runs:
        restored.setdefault(job_id, f"restored by run {run_id}")
    unsettled = [job for job in jobs if job.pk not in restored]
    with connections[DB].cursor() as cursor:  # one query for the page's whole list
        cursor.execute("SELECT n FROM unnest(%s::text[]) AS n WHERE to_regclass(n) IS NOT NULL",
                       [[job.partition for job in unsettled]])
        existing = {name for (name,) in cursor.fetchall()}
    for job in unsettled:
        if job.partition in existing:
            restored[job.pk] = f"a table named {job.partition} exists"
    return restored


def restorable_job(job_id: object, attach: bool) -> PartitionArchivalJob:
    """The finished archival job ``job_id`` if its archive may be restored now, else ``MaintenanceRefused``."""
    try:
        pk = int(str(job_id))
    except ValueError:
        raise MaintenanceRefused(f"{job_id!r} is not an archival job id") from None
    job = PartitionArchivalJob.objects.using(DB).filter(pk=pk).first()
    if job is None:
        raise MaintenanceRefused(f"no archival job {pk}")
    if job.step != ArchivalStep.DROPPED or not job.archive_path:
        raise MaintenanceRefused(f"archival job {pk} ({job.partition}) is {job.step}, not a finished archive")
    if not Path(job.archive_path).is_file():
        raise MaintenanceRefused(f"the archive of {job.partition} is missing: no file {job.archive_path}")
    already = restored_job_ids([job]).get(job.pk)
    if already:
        raise MaintenanceRefused(f"the archive of {job.partition} (job {pk}) is already restored: {already}")
    if attach:
        clash = [p.name for p in catalog.range_partitions(job.parent_table, DB)
                 if p.bounds.overlaps(TimeRange(job.range_start, job.range_end))]
        if clash:
            raise MaintenanceRefused(f"{', '.join(clash)} already covers part of {job.partition}'s range; "
                                     "restore it as a standalone table instead")
    return job


# ---------------------------------------------------------------------- requests
def request_rotation(user) -> MaintenanceRun:
    """Queue "rotate now": the plan the page shows, made again by the worker and applied."""
    return _enqueue(MaintenanceRun(action=MaintenanceAction.ROTATE, target="all partitioned tables",
                                   requested_by=user))


def request_archival(user, partition: str) -> MaintenanceRun:
    """Queue the archival of ``partition`` (detach, export, verify, drop), if it may be archived."""
    info = archivable_partition(partition)
    return _enqueue(MaintenanceRun(action=MaintenanceAction.ARCHIVE, target=info.name, requested_by=user,
                                   options={"parent": info.parent, "start": info.bounds.start.isoformat(),
                                            "end": info.bounds.end.isoformat()}))


def request_restore(user, job_id: object, attach: bool = False) -> MaintenanceRun:
    """Queue the restore of archival job ``job_id``'s archive, standalone or attached to its parent."""
    job = restorable_job(job_id, attach)
    return _enqueue(MaintenanceRun(action=MaintenanceAction.RESTORE, target=job.archive_path, archival_job_id=job.pk,
                                   requested_by=user, options={"attach": bool(attach), "partition": job.partition}))


def _enqueue(run: MaintenanceRun) -> MaintenanceRun:
    """Record ``run`` and send its task once the row is committed (a worker must find it).

    A broker that refuses the message leaves the run ``failed`` with why: the request was made,
    and the record says it never ran.
    """
    run.task_id = str(uuid.uuid4())
    with transaction.atomic(using=DB):
        run.save(using=DB)
        transaction.on_commit(lambda: _send(run), using=DB)
    return run


def _send(run: MaintenanceRun) -> None:
    try:
        current_app.send_task(TASK_NAME, args=[run.pk], queue=QUEUE, task_id=run.task_id)
    except Exception as exc:  # the broker is down or refuses: the run never starts
        logger.warning("maintenance run %s could not be queued: %s", run.pk, exc)
        now = timezone.now()
        run.status, run.error, run.finished_at = MaintenanceRunStatus.FAILED, f"could not be queued: {exc}", now
        MaintenanceRun.objects.using(DB).filter(pk=run.pk).update(
            status=run.status, error=run.error, finished_at=now, updated_at=now)
