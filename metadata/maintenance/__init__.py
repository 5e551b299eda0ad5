"""Maintenance from the admin: "rotate now", "archive this partition", "restore this archive".

An operator's request is checked here first (``requests``): a partition that is unknown, the
DEFAULT or inside the retention, or an archive that is gone or already restored, is refused with
a ``MaintenanceRefused`` that says why, and nothing is recorded. An accepted request becomes a
``MaintenanceRun`` row (who, when, what) and a Celery task on the ``maintenance`` queue
(``metadata.tasks.run_maintenance``), which runs it (``runner``) with the existing rotation,
archiver and restore, under the maintenance advisory lock, writing progress and outcome to the
row as it goes. A run that finds the lock held ends ``skipped`` at once, having done nothing.

Modules: ``requests`` (validate and enqueue), ``runner`` (execute one run in a worker, progress),
``views`` (what the admin shows of runs).
"""
from __future__ import annotations

from metadata.maintenance.requests import (
    ACTIVE,
    FINISHED,
    MaintenanceRefused,
    archivable_partition,
    archive_cutoff,
    request_archival,
    request_restore,
    request_rotation,
    restorable_job,
    restored_job_ids,
)
from metadata.maintenance.views import run_as_dict

__all__ = [
    "ACTIVE", "FINISHED", "MaintenanceRefused",
    "archivable_partition", "archive_cutoff", "request_archival", "request_restore", "request_rotation",
    "restorable_job", "restored_job_ids", "run_as_dict",
]
