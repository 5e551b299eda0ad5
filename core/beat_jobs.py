"""Register a periodic task in django-celery-beat's database schedule, once.

Every app's beat jobs are registered through this one helper, by its own data migrations and by
``partitions schedule``: idempotent by job name, and whatever an operator changed in the admin
afterwards (interval, queue, enabled) is left alone. Takes the app registry it is given, so a
migration can pass its historical models.

Each app declares its jobs (``declare_jobs``, from its ``ready()``), so a command of a lower app
registers the jobs of the apps above it without naming them (``declared_jobs``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from django.apps import apps as global_apps
from django.apps.registry import Apps
from django.db import DEFAULT_DB_ALIAS, transaction
from django.utils import timezone

from core.queues import MAINTENANCE_QUEUE


@dataclass(frozen=True)
class PeriodicJob:
    """One beat job: its name in the schedule, the task it runs, and how often."""

    name: str
    task: str
    every_minutes: int
    every_seconds: int = 0  # when set, the interval in seconds instead (jobs more often than a minute)

    @property
    def interval(self) -> tuple[int, str]:
        """``(every, period)`` of its django-celery-beat ``IntervalSchedule``."""
        return (self.every_seconds, "seconds") if self.every_seconds else (self.every_minutes, "minutes")


_providers: dict[str, Callable[[], list[PeriodicJob]]] = {}


def declare_jobs(app: str, jobs: Callable[[], list[PeriodicJob]]) -> None:
    """``app``'s beat jobs (a callable: intervals may come from settings), for ``declared_jobs``."""
    _providers[app] = jobs


def declared_jobs() -> list[PeriodicJob]:
    """Every app's declared beat jobs."""
    return [job for jobs in _providers.values() for job in jobs()]


def register_jobs(jobs: Iterable[PeriodicJob], apps: Apps = global_apps, using: str = DEFAULT_DB_ALIAS, *,
                  registered_by: str) -> list[str]:
    """Create the missing ``jobs`` on the maintenance queue, all or nothing; return the names created.

    Reads and writes go to ``using`` (the primary): a lagging replica would make it register twice.
    """
    created = []
    with transaction.atomic(using=using):  # all or nothing; and the router keeps reads on the primary
        for job in jobs:
            every, period = job.interval
            if register_periodic_job(apps, using, name=job.name, task=job.task, every=every, period=period,
                                     queue=MAINTENANCE_QUEUE,
                                     description=f"Registered by {registered_by}; edit freely."):
                created.append(job.name)
    return created


def register_periodic_job(apps: Apps = global_apps, using: str = DEFAULT_DB_ALIAS, *, name: str, task: str, every: int,
                          period: str, queue: str, description: str) -> bool:
    """Create the periodic task ``name`` unless one of that name exists; True when it was created.

    ``every`` and ``period`` make its ``IntervalSchedule`` (``period`` as django-celery-beat
    spells it: "seconds", "minutes", ...). Reads and writes go to ``using``, which should be the
    primary: a lagging replica would make it register twice.
    """
    task_model = apps.get_model("django_celery_beat", "PeriodicTask")
    if task_model.objects.using(using).filter(name=name).exists():
        return False
    interval_model = apps.get_model("django_celery_beat", "IntervalSchedule")
    interval, _ = interval_model.objects.using(using).get_or_create(every=every, period=period)
    task_model.objects.using(using).create(name=name, task=task, interval=interval, queue=queue,
                                           description=description)
    # Tell a running beat to reload its schedule (signals do not fire on historical models).
    apps.get_model("django_celery_beat", "PeriodicTasks").objects.using(using).update_or_create(
        ident=1, defaults={"last_update": timezone.now()})
    return True
