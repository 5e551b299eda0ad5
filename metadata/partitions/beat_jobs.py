"""The store's periodic maintenance jobs, registered in django-celery-beat's database schedule.

Registration (``core.beat_jobs``) is idempotent by job name and leaves alone what an operator
changed in the admin afterwards (interval, enabled); the data migrations run it once, and
``partitions schedule`` runs it again on demand, with the jobs every other app declared.
"""
from __future__ import annotations

from django.apps import apps as global_apps
from django.db import DEFAULT_DB_ALIAS

from core.beat_jobs import PeriodicJob, register_jobs
from core.queues import MAINTENANCE_QUEUE
from metadata.conf import conf

__all__ = ["MAINTENANCE_QUEUE", "PeriodicJob", "periodic_jobs", "register_periodic_tasks"]


def periodic_jobs() -> list[PeriodicJob]:
    return [
        PeriodicJob("specops: rotate partitions", "metadata.tasks.rotate_partitions",
                    int(conf.PARTITION_ROTATE_MINUTES)),
        PeriodicJob("specops: rotate recent-activity index", "metadata.tasks.rotate_recent_activity_index",
                    int(conf.RECENT_INDEX_ROTATE_MINUTES)),
        PeriodicJob("specops: cache stats snapshot", "metadata.cache.snapshot_cache_stats", 1),
    ]


def register_periodic_tasks(apps=global_apps, using: str = DEFAULT_DB_ALIAS) -> list[str]:
    """Create the store's missing periodic tasks; return the names created (empty when all exist)."""
    return register_jobs(periodic_jobs(), apps, using, registered_by="metadata.partitions.beat_jobs")
