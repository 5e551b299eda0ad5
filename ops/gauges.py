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
    model_files,
    queue_lengths,
)

__all__ = ["archival_job_counts", "default_partition_rows", "model_files", "queue_lengths", "sample_and_set_gauges"]

QUEUE_LENGTH = Gauge("specops_celery_queue_length", "Messages waiting in a Celery queue.", ["queue"],
                     multiprocess_mode="mostrecent")
DEFAULT_PARTITION_ROWS = Gauge("specops_partition_default_rows", "Rows in a table's DEFAULT partition.",
                               ["table"], multiprocess_mode="mostrecent")
ARCHIVAL_JOBS = Gauge("specops_archival_jobs", "Partition archival jobs by step.", ["step"],
                      multiprocess_mode="mostrecent")
MODEL_FILES_AVAILABLE = Gauge(
    "specops_model_files_available",
    "1 when this host has every file loading an active or staged model version reads, 0 when some are "
    "missing or unreadable (the version is unavailable: its requests are refused with a 503).",
    ["model", "version", "role"], multiprocess_mode="mostrecent")


def sample_and_set_gauges() -> dict:
    """Set the gauges from the broker and the database; return what was sampled."""
    sample = {"queues": queue_lengths(device_queues()), "default_rows": default_partition_rows(),
              "archival_jobs": archival_job_counts(), "model_files": model_files()}
    for name, value in sample["queues"].items():
        QUEUE_LENGTH.labels(name).set(value)
    for table, value in sample["default_rows"].items():
        DEFAULT_PARTITION_ROWS.labels(table).set(value)
    for step, value in sample["archival_jobs"].items():
        ARCHIVAL_JOBS.labels(step).set(value)
    for files in sample["model_files"]:
        MODEL_FILES_AVAILABLE.labels(files["model"], files["version"], files["role"]).set(0 if files["missing"] else 1)
    return sample
