"""The ops app's beat tasks (found by autodiscovery, and imported by ``OpsConfig.ready``).

Both run on the maintenance queue (``specops.celery`` routes ``ops.*`` there) and are registered
with beat by name (`periodic_jobs`, by ops migration 0002): ``ops.sample_ops_metrics`` every
minute, ``ops.roll_up_ops`` every 30 s.
"""
from __future__ import annotations

from celery import shared_task

from core.beat_jobs import PeriodicJob
from ops.gauges import sample_and_set_gauges
from ops.rollups import roll_up

__all__ = ["periodic_jobs", "roll_up_ops", "sample_ops_metrics"]


def periodic_jobs() -> list[PeriodicJob]:
    return [
        PeriodicJob("specops: sample operational gauges", "ops.sample_ops_metrics", 1),
        PeriodicJob("specops: roll up operational metrics", "ops.roll_up_ops", 0, every_seconds=30),
    ]


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
