"""The operators' Prometheus gauges, set from one sample of the broker and the database.

Gauges are sampled on a schedule (the ``ops.sample_ops_metrics`` beat task, ``ops.tasks``), not
at scrape time, because /metrics is served from several processes through
PROMETHEUS_MULTIPROC_DIR, where a scrape-time collector would not be aggregated; they use the
``mostrecent`` mode so the latest sample wins whichever process took it.
"""
from __future__ import annotations

from prometheus_client import Gauge

from ops.readings import (
    archival_job_counts,
    default_partition_rows,
    device_queues,
    queue_lengths,
)

__all__ = ["archival_job_counts", "default_partition_rows", "queue_lengths", "sample_and_set_gauges"]

QUEUE_LENGTH = Gauge("specops_celery_queue_length", "Messages waiting in a Celery queue.", ["queue"],
                     multiprocess_mode="mostrecent")
DEFAULT_PARTITION_ROWS = Gauge("specops_partition_default_rows", "Rows in a table's DEFAULT partition.",
                               ["table"], multiprocess_mode="mostrecent")
ARCHIVAL_JOBS = Gauge("specops_archival_jobs", "Partition archival jobs by step.", ["step"],
                      multiprocess_mode="mostrecent")


def sample_and_set_gauges() -> dict:
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
