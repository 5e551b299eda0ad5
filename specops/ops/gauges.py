"""Operational gauges sampled by a beat job: queue backlog, default partitions, archival jobs.

Sampled on a schedule (not at scrape time) because /metrics is served from several processes
through PROMETHEUS_MULTIPROC_DIR, where a scrape-time collector would not be aggregated; the
gauges use the ``mostrecent`` mode so the latest sample wins whichever process took it.
"""
from __future__ import annotations

import logging

from celery import shared_task
from django.db import connection
from django.db.models import Count
from prometheus_client import Gauge

from metadata.models import PARTITIONED_TABLES, PartitionArchivalJob
from specops.celery import CPU_QUEUE, MAINTENANCE_QUEUE, app, gpu_queue, visible_gpu_count

logger = logging.getLogger(__name__)

QUEUE_LENGTH = Gauge("specops_celery_queue_length", "Messages waiting in a Celery queue.", ["queue"],
                     multiprocess_mode="mostrecent")
DEFAULT_PARTITION_ROWS = Gauge("specops_partition_default_rows", "Rows in a table's DEFAULT partition.",
                               ["table"], multiprocess_mode="mostrecent")
ARCHIVAL_JOBS = Gauge("specops_archival_jobs", "Partition archival jobs by step.", ["step"],
                      multiprocess_mode="mostrecent")


def queue_lengths(queues: list[str]) -> dict[str, int]:
    """Messages ready in each queue (a passive declare: works on Redis and RabbitMQ)."""
    lengths = {}
    with app.connection_for_read() as conn:
        for name in queues:
            try:
                lengths[name] = conn.default_channel.queue_declare(queue=name, passive=True).message_count
            except Exception:  # a queue nobody declared yet holds nothing
                lengths[name] = 0
    return lengths


def default_partition_rows() -> dict[str, int]:
    rows = {}
    with connection.cursor() as cursor:
        for table in PARTITIONED_TABLES:
            cursor.execute(f'SELECT count(*) FROM "{table}_default"')
            rows[table] = cursor.fetchone()[0]
    return rows


def archival_job_counts() -> dict[str, int]:
    from metadata.models import ArchivalStep

    counts = dict.fromkeys(ArchivalStep.values, 0)
    for row in PartitionArchivalJob.objects.values("step").annotate(n=Count("id")):
        counts[row["step"]] = row["n"]
    return counts


@shared_task(name="specops.sample_ops_metrics")
def sample_ops_metrics() -> dict:
    """Set the gauges from the broker and the database; return what was sampled."""
    queues = [CPU_QUEUE, MAINTENANCE_QUEUE] + [gpu_queue(i) for i in range(visible_gpu_count())]
    sample = {"queues": queue_lengths(queues), "default_rows": default_partition_rows(),
              "archival_jobs": archival_job_counts()}
    for name, value in sample["queues"].items():
        QUEUE_LENGTH.labels(name).set(value)
    for table, value in sample["default_rows"].items():
        DEFAULT_PARTITION_ROWS.labels(table).set(value)
    for step, value in sample["archival_jobs"].items():
        ARCHIVAL_JOBS.labels(step).set(value)
    return sample
