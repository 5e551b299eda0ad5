"""Register the pg_stat_statements snapshot job with celery beat (idempotent, by task name)."""
from django.db import migrations


def register(apps, schema_editor):
    from metadata.insights.beat import register_snapshot_job

    register_snapshot_job(apps, using=schema_editor.connection.alias)


class Migration(migrations.Migration):

    dependencies = [
        ("metadata", "0008_statement_snapshots"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(register, migrations.RunPython.noop)]
