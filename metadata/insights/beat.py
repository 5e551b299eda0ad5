"""The snapshot job in django-celery-beat's schedule: registered once, by task name, then the operator's.

Like ``metadata.partitions.beat_jobs``: idempotent, and what an operator changed afterwards
(interval, enabled) is left alone. Migration 0007 runs it; so can a shell, any time.
"""
from __future__ import annotations

from django.apps import apps as global_apps
from django.db import DEFAULT_DB_ALIAS, transaction
from django.utils import timezone

from metadata.conf import conf

SNAPSHOT_TASK = "metadata.insights.snapshot_statements"
SNAPSHOT_JOB = "specops: snapshot pg_stat_statements"
MAINTENANCE_QUEUE = "maintenance"


def register_snapshot_job(apps=global_apps, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Create the periodic task unless a task of that name exists; True when it was created."""
    interval_model = apps.get_model("django_celery_beat", "IntervalSchedule")
    task_model = apps.get_model("django_celery_beat", "PeriodicTask")
    changed_model = apps.get_model("django_celery_beat", "PeriodicTasks")
    with transaction.atomic(using=using):
        if task_model.objects.using(using).filter(task=SNAPSHOT_TASK).exists():
            return False
        every = int(conf.INSIGHTS_SNAPSHOT_MINUTES)
        interval, _ = interval_model.objects.using(using).get_or_create(every=every, period="minutes")
        task_model.objects.using(using).create(
            name=SNAPSHOT_JOB, task=SNAPSHOT_TASK, interval=interval, queue=MAINTENANCE_QUEUE,
            description="Registered by metadata.insights.beat; edit freely.")
        # Tell a running beat to reload its schedule (signals do not fire on historical models).
        changed_model.objects.using(using).update_or_create(ident=1, defaults={"last_update": timezone.now()})
    return True
