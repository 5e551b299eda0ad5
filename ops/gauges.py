"""The beat entries of the operator views: Prometheus gauges sampled on a schedule, and the rollups.

Gauges are sampled on a schedule (not at scrape time) because /metrics is served from several
processes through PROMETHEUS_MULTIPROC_DIR, where a scrape-time collector would not be
aggregated; they use the ``mostrecent`` mode so the latest sample wins whichever process took it.
``roll_up_ops`` is the rollup job's entry (``ops.rollups``); it lives here because this
module is the one the worker imports (``ops.tasks``).
"""
from __future__ import annotations

import logging

from celery import shared_task
from prometheus_client import Gauge

from ops.readings import (
    archival_job_counts,
    default_partition_rows,
    device_queues,
    queue_lengths,
)

logger = logging.getLogger(__name__)

__all__ = ["archival_job_counts", "default_partition_rows", "queue_lengths", "roll_up_ops", "sample_ops_metrics"]

QUEUE_LENGTH = Gauge("specops_celery_queue_length", "Messages waiting in a Celery queue.", ["queue"],
                     multiprocess_mode="mostrecent")
DEFAULT_PARTITION_ROWS = Gauge("specops_partition_default_rows", "Rows in a table's DEFAULT partition.",
                               ["table"], multiprocess_mode="mostrecent")
ARCHIVAL_JOBS = Gauge("specops_archival_jobs", "Partition archival jobs by step.", ["step"],
                      multiprocess_mode="mostrecent")


@shared_task(name="specops.sample_ops_metrics")
def sample_ops_metrics() -> dict:
    """Set the gauges from the broker and the database; return what was sampled."""
    sample = {"queues": queue_lengths(device_queues()), "default_rows": default_partition_rows(),
              "archival_jobs": archival_job_counts()}
    for name, value in sample["queues"].items():
        QUEUE_LENGTH.labels(name).set(value)
    for table, value in sample["default_rows"].items():
        DEFAULT_PARTITION_ROWS.labels(table).set(value)
    for step, value in sample["archival_jobs"].items():
        ARCHIVAL_JOBS.labels(step).set(value)
    return sample


@shared_task(name="specops.roll_up_ops")
def roll_up_ops() -> dict:
    """Beat entry (every 30 s, registered by migration metadata 0007): one rollup run."""
    from ops.rollups import roll_up

    run = roll_up()
    return {"start": run.start and run.start.isoformat(), "end": run.end and run.end.isoformat(),
            "sessions": run.sessions, "rows": run.rows, "caught_up": run.caught_up, "skipped": run.skipped}
