"""Register the maintenance jobs (partition rotation, recent-activity index) with celery beat."""
from django.db import migrations


def register(apps, schema_editor):
    from metadata.schedule import register_periodic_tasks

    register_periodic_tasks(apps, using=schema_editor.connection.alias)


class Migration(migrations.Migration):

    dependencies = [
        ("metadata", "0003_archival_job_resume_fields"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(register, migrations.RunPython.noop)]
