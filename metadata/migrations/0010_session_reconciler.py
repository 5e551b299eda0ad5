"""Crash safety, second part: when a session's task was last enqueued.

``enqueued_at`` lets the reconciler tell a session whose task the broker lost (queued long after
its last enqueue) from one that is merely waiting. The store's beat jobs are registered again
(``metadata.partitions.beat_jobs``, idempotently by name); the reconciler's own job is the
inference app's to register (its migration 0008).
"""
from django.db import migrations, models


def register(apps, schema_editor):
    from metadata.partitions.beat_jobs import register_periodic_tasks

    register_periodic_tasks(apps, using=schema_editor.connection.alias)


class Migration(migrations.Migration):

    dependencies = [
        ("metadata", "0009_register_statement_snapshot_job"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [
        migrations.AddField(model_name="session", name="enqueued_at",
                            field=models.DateTimeField(blank=True, null=True)),
        migrations.RunPython(register, migrations.RunPython.noop),
    ]
