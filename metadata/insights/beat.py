"""The snapshot job in django-celery-beat's schedule: registered once, by job name, then the operator's.

Registered through ``core.beat_jobs`` like every beat job: idempotent, and what an operator
changed afterwards (interval, enabled) is left alone. Migration 0009 runs it; so can a shell,
any time.
"""
from __future__ import annotations

from django.apps import apps as global_apps
from django.db import DEFAULT_DB_ALIAS, transaction

from core.beat_jobs import register_periodic_job
from core.queues import MAINTENANCE_QUEUE
from metadata.conf import conf

SNAPSHOT_TASK = "metadata.insights.snapshot_statements"
SNAPSHOT_JOB = "specops: snapshot pg_stat_statements"


def register_snapshot_job(apps=global_apps, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Create the periodic task unless a task of that name exists; True when it was created."""
    with transaction.atomic(using=using):  # and the router keeps the existence check on the primary
        return register_periodic_job(apps, using, name=SNAPSHOT_JOB, task=SNAPSHOT_TASK,
                                     every=int(conf.INSIGHTS_SNAPSHOT_MINUTES), period="minutes",
                                     queue=MAINTENANCE_QUEUE,
                                     description="Registered by metadata.insights.beat; edit freely.")
