"""Beat registration (django-celery-beat) and the maintenance tasks themselves."""
from __future__ import annotations

import psycopg
from django.db import connection, transaction
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from metadata.models import PARTITIONED_TABLES
from metadata.partitions import (
    PARTITION_MAINTENANCE_LOCK,
    bin_start,
    catalog,
    periodic_jobs,
    register_periodic_tasks,
)
from metadata.partitions.locks import session_settings
from metadata.tasks import rotate_partitions, rotate_recent_activity_index
from specops.celery import app


def test_registration_is_idempotent_and_respects_operator_edits(transactional_db, settings) -> None:
    settings.SPECOPS_PARTITION_ROTATE_MINUTES = 15
    with transaction.atomic():  # (reads inside a transaction stay on the primary)
        PeriodicTask.objects.all().delete()  # a fresh install: the migration registered them earlier
    created = register_periodic_tasks()
    assert sorted(created) == sorted(job.name for job in periodic_jobs())
    rotation = PeriodicTask.objects.using("default").select_related("interval").get(task="metadata.tasks.rotate_partitions")
    assert (rotation.interval.every, rotation.interval.period, rotation.queue) == (15, "minutes", "maintenance")
    PeriodicTask.objects.using("default").filter(pk=rotation.pk).update(enabled=False)  # an operator pauses it
    assert register_periodic_tasks() == []
    assert PeriodicTask.objects.using("default").filter(task__startswith="metadata.tasks.").count() == 2
    assert not PeriodicTask.objects.using("default").get(pk=rotation.pk).enabled


def test_beat_tasks_exist_and_go_to_the_maintenance_queue() -> None:
    for job in periodic_jobs():
        assert job.task in app.tasks
        assert app.amqp.router.route({}, job.task)["queue"].name == "maintenance"


def test_rotate_task_makes_todays_partitions_and_skips_when_busy(partitioned) -> None:
    result = rotate_partitions()
    assert result["failed"] == [] and len(result["created"]) == 5 * len(PARTITIONED_TABLES)  # today + 4 ahead, per table
    today = bin_start(timezone.now(), catalog.range_partitions("metadata_token")[0].bounds.end
                      - catalog.range_partitions("metadata_token")[0].bounds.start)
    assert catalog.partition_covering("metadata_token", today) is not None
    assert rotate_partitions()["created"] == []  # idempotent
    params = session_settings()  # the primary itself: a lock through PgBouncer would outlive this test
    with psycopg.connect(dbname=params["NAME"], host=params["HOST"], port=params["PORT"], user=params["USER"],
                         autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (PARTITION_MAINTENANCE_LOCK,))
        assert "another maintenance run" in rotate_partitions()["skipped"]


def test_recent_index_task_builds_the_index(partitioned) -> None:
    name = rotate_recent_activity_index()["index"]
    assert name.startswith("session_recent_activity_")
    assert rotate_recent_activity_index()["index"] == name
