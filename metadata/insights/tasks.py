"""The beat job of the insights: one pg_stat_statements snapshot of every database alias."""
from __future__ import annotations

import logging
from dataclasses import asdict

from celery import shared_task

from metadata.insights.beat import SNAPSHOT_TASK
from metadata.insights.statement_snapshots import StatementSnapshotter
from metadata.partitions import MaintenanceLockBusy

logger = logging.getLogger(__name__)


@shared_task(name=SNAPSHOT_TASK, soft_time_limit=50, time_limit=60)
def snapshot_statements() -> dict:
    """Snapshot pg_stat_statements deltas (skipped at once while another snapshot runs)."""
    try:
        report = StatementSnapshotter().run()
    except MaintenanceLockBusy as exc:
        logger.info("snapshot_statements skipped: %s", exc)
        return {"skipped": str(exc)}
    logger.info("snapshot_statements: %s", report.summary())
    return {"taken_at": report.taken_at.isoformat(), "databases": [asdict(d) for d in report.databases]}
