"""The periodic maintenance jobs, registered in django-celery-beat's database schedule.

Registration is idempotent (by task name) and leaves alone what an operator changed in the admin
afterwards (interval, enabled); the data migration runs it once, and ``partitions schedule``
runs it again on demand.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.apps import apps as global_apps
from django.db import DEFAULT_DB_ALIAS, transaction
from django.utils import timezone

from metadata.conf import conf

MAINTENANCE_QUEUE = "maintenance"


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
        PeriodicJob("specops: cache stats snapshot", "metadata.cache_tasks.snapshot_cache_stats", 1),
        PeriodicJob("specops: sample operational gauges", "specops.sample_ops_metrics", 1),
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
        _register(apps, using, created)
    return created


def _register(apps, using: str, created: list[str]) -> None:
    interval_model = apps.get_model("django_celery_beat", "IntervalSchedule")
    task_model = apps.get_model("django_celery_beat", "PeriodicTask")
    changed_model = apps.get_model("django_celery_beat", "PeriodicTasks")
    for job in periodic_jobs():
        if task_model.objects.using(using).filter(name=job.name).exists():
            continue
        every, period = job.interval
        interval, _ = interval_model.objects.using(using).get_or_create(every=every, period=period)
        task_model.objects.using(using).create(name=job.name, task=job.task, interval=interval, queue=MAINTENANCE_QUEUE,
                                  description="Registered by metadata.partitions.beat_jobs; edit freely.")
        created.append(job.name)
    if created:  # tell a running beat to reload its schedule (signals do not fire on historical models)
        changed_model.objects.using(using).update_or_create(ident=1, defaults={"last_update": timezone.now()})
