"""The periodic maintenance jobs, registered in django-celery-beat's database schedule.

Registration (``core.beat_jobs``) is idempotent by job name and leaves alone what an operator changed in the admin
afterwards (interval, enabled); the data migration runs it once, and ``partitions schedule``
runs it again on demand.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.apps import apps as global_apps
from django.db import DEFAULT_DB_ALIAS, transaction

from core.beat_jobs import register_periodic_job
from core.queues import MAINTENANCE_QUEUE
from metadata.conf import conf

__all__ = ["MAINTENANCE_QUEUE", "PeriodicJob", "periodic_jobs", "register_periodic_tasks"]


@dataclass(frozen=True)
class PeriodicJob:
    name: str
    task: str
    every_minutes: int
    every_seconds: int = 0  # when set, the interval in seconds instead (jobs more often than a minute)

    @property
    def interval(self) -> tuple[int, str]:
        """``(every, period)`` of its django-celery-beat ``IntervalSchedule``."""
        return (self.every_seconds, "seconds") if self.every_seconds else (self.every_minutes, "minutes")


def periodic_jobs() -> list[PeriodicJob]:
    return [
        PeriodicJob("specops: rotate partitions", "metadata.tasks.rotate_partitions",
                    int(conf.PARTITION_ROTATE_MINUTES)),
        PeriodicJob("specops: rotate recent-activity index", "metadata.tasks.rotate_recent_activity_index",
                    int(conf.RECENT_INDEX_ROTATE_MINUTES)),
        PeriodicJob("specops: cache stats snapshot", "metadata.cache.snapshot_cache_stats", 1),
        PeriodicJob("specops: sample operational gauges", "ops.sample_ops_metrics", 1),
        # Sessions whose worker died or whose task the broker lost (inference.worker.reconciler):
        # with the 30 s lease, a dead worker's session is back on its queue within ~45 s.
        PeriodicJob("specops: reconcile sessions", "inference.reconcile_sessions", 0, every_seconds=15),
    ]


def register_periodic_tasks(apps=global_apps, using: str = DEFAULT_DB_ALIAS) -> list[str]:
    """Create the missing periodic tasks; return the names created (empty when all exist).

    Reads and writes go to ``using`` (the primary): a lagging replica would make it register twice.
    """
    created = []
    with transaction.atomic(using=using):  # all or nothing; and the router keeps reads on the primary
        for job in periodic_jobs():
            every, period = job.interval
            if register_periodic_job(apps, using, name=job.name, task=job.task, every=every, period=period,
                                     queue=MAINTENANCE_QUEUE,
                                     description="Registered by metadata.partitions.beat_jobs; edit freely."):
                created.append(job.name)
    return created
