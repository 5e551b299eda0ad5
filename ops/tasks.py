"""The ops app's beat tasks (found by autodiscovery, and imported by ``OpsConfig.ready``).

Both run on the maintenance queue (``specops.celery`` routes ``ops.*`` there) and are registered
with beat by name: ``ops.sample_ops_metrics`` every minute (``metadata.partitions.beat_jobs``),
``ops.roll_up_ops`` every 30 s (metadata migration 0007, renamed by 0014).
"""
from __future__ import annotations

from celery import shared_task

from ops.gauges import sample_and_set_gauges
from ops.rollups import roll_up

__all__ = ["roll_up_ops", "sample_ops_metrics"]


@shared_task(name="ops.sample_ops_metrics")
def sample_ops_metrics() -> dict:
    """Set the Prometheus gauges from the broker and the database; return what was sampled."""
    return sample_and_set_gauges()


@shared_task(name="ops.roll_up_ops")
def roll_up_ops() -> dict:
    """One run of the rollup job (``ops.rollups.roll_up``); returns what it did."""
    run = roll_up()
    return {"start": run.start and run.start.isoformat(), "end": run.end and run.end.isoformat(),
            "sessions": run.sessions, "rows": run.rows, "caught_up": run.caught_up, "skipped": run.skipped}
