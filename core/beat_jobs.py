"""Register a periodic task in django-celery-beat's database schedule, once.

Every app's beat jobs are registered through this one helper, by data migrations and by commands
(``partitions schedule``): idempotent by job name, and whatever an operator changed in the admin
afterwards (interval, queue, enabled) is left alone. Takes the app registry it is given, so a
migration can pass its historical models.
"""
from __future__ import annotations

from django.apps import apps as global_apps
from django.apps.registry import Apps
from django.db import DEFAULT_DB_ALIAS
from django.utils import timezone


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
