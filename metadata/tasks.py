"""Celery jobs of the metadata store (routed to the ``maintenance`` queue): beat's and the admin's.

The beat jobs are idempotent and take their own ``pg_try_advisory_lock``: a run that finds the
lock taken returns at once instead of queueing behind the other run. ``run_maintenance`` runs one
action an operator started from the admin (``metadata.maintenance``), recorded as a
``MaintenanceRun``, under the same lock.
"""
from __future__ import annotations

import logging
from dataclasses import asdict

from celery import shared_task

from metadata.cache.stats_snapshots import snapshot_cache_stats  # noqa: F401  (registers the beat task)
from metadata.maintenance.runner import execute_run
from metadata.partitions import MaintenanceLockBusy, PartitionRotation, rotate_recent_index

logger = logging.getLogger(__name__)


# Archival of a big backlog can take long; a killed run resumes from its recorded steps.
@shared_task(name="metadata.tasks.rotate_partitions", soft_time_limit=3300, time_limit=3600)
def rotate_partitions() -> dict:
    """Premake partitions, drain DEFAULT, archive expired partitions: the plan that
    ``partitions rotate --dry-run`` prints, made now and applied."""
    try:
        report = PartitionRotation().run()
    except MaintenanceLockBusy as exc:
        logger.info("rotate_partitions skipped: %s", exc)
        return {"skipped": str(exc)}
    logger.info("rotate_partitions: %s", report.summary())
    return asdict(report)


@shared_task(name="metadata.tasks.rotate_recent_activity_index", soft_time_limit=1700, time_limit=1800)
def rotate_recent_activity_index() -> dict:
    """Rebuild the recent-activity partial index with a fresh literal cutoff."""
    try:
        return {"index": rotate_recent_index()}
    except MaintenanceLockBusy as exc:
        logger.info("rotate_recent_activity_index skipped: %s", exc)
        return {"skipped": str(exc)}


@shared_task(bind=True, name="metadata.tasks.run_maintenance", soft_time_limit=3300, time_limit=3600)
def run_maintenance(self, run_id: int) -> dict:
    """Run the admin's maintenance run ``run_id`` (rotate, archive or restore), recording progress."""
    return execute_run(run_id, self.request.id or "")
