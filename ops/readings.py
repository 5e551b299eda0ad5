"""Point-in-time readings of the platform, shared by the Prometheus gauges and the rollups.

Each reader asks its source directly (the broker, the DEFAULT partitions, the replicas' probes,
``pg_stat_database``); none scans a table that grows with traffic.
"""
from __future__ import annotations

import logging

from celery import current_app as app
from django.conf import settings
from django.db import connection, connections
from django.db.models import Count

from core.queues import CPU_QUEUE, MAINTENANCE_QUEUE, gpu_queue, visible_gpu_count
from inference import version_files
from metadata.models import ModelVersion, VersionStatus
from metadata.models import PARTITIONED_TABLES, ArchivalStep, PartitionArchivalJob

logger = logging.getLogger(__name__)


def device_queues() -> list[str]:
    """The queues worth watching: cpu, maintenance, and one per visible GPU."""
    return [CPU_QUEUE, MAINTENANCE_QUEUE] + [gpu_queue(i) for i in range(visible_gpu_count())]


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
    """Exact rows in each table's DEFAULT partition (kept empty by the rotation, so cheap)."""
    rows = {}
    with connection.cursor() as cursor:
        for table in PARTITIONED_TABLES:
            cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [f'"{table}_default"'])
            if cursor.fetchone()[0]:  # a table without a DEFAULT partition (yet) has nothing there
                cursor.execute(f'SELECT count(*) FROM "{table}_default"')
                rows[table] = cursor.fetchone()[0]
    return rows


def model_files() -> list[dict[str, str | None]]:
    """Each version that serves or may be promoted (active or staged): its model, version and role,
    and ``missing``, what of its files this host lacks (None: all there); a few rows, a few stats each."""
    versions = ModelVersion.objects.filter(status__in=(VersionStatus.ACTIVE, VersionStatus.STAGED)).order_by("pk")
    return [{"model": v.name, "version": v.version, "role": v.role, "missing": version_files.missing_files(v)}
            for v in versions]


def archival_job_counts() -> dict[str, int]:
    counts = dict.fromkeys(ArchivalStep.values, 0)
    for row in PartitionArchivalJob.objects.values("step").annotate(n=Count("id")):
        counts[row["step"]] = row["n"]
    return counts


def replica_positions() -> list[tuple[str, int | None, bool]]:
    """(alias, lag in WAL bytes or None, up) of each replica, from the router's last probe."""
    from metadata.replicas.health import replica_health

    return [(p.alias, p.lag_bytes, p.up) for p in replica_health().snapshot().replicas]


def database_transactions() -> dict[str, int]:
    """Cumulative transactions of this database on each server (primary and replicas)."""
    totals = {}
    for alias in ["default", *settings.DATABASE_REPLICAS]:  # DATABASE_REPLICAS: always set by specops.settings
        try:
            with connections[alias].cursor() as cursor:
                cursor.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database "
                               "WHERE datname = current_database()")
                totals[alias] = int(cursor.fetchone()[0])
        except Exception:  # a replica that is down has no count this time
            logger.info("sampling: %s did not answer for pg_stat_database", alias)
    return totals
