"""Register this app's beat job (``inference.tasks.periodic_jobs``): the sessions' reconciler every 15 s.

Idempotent by job name (``core.beat_jobs``): a database that has it already (the store's
migrations registered it before this app registered its own) keeps it as an operator left it.
Migrating backwards leaves it (disable it in the admin).
"""
from django.db import migrations


def register(apps, schema_editor):
    from core.beat_jobs import register_jobs
    from inference.tasks import periodic_jobs

    register_jobs(periodic_jobs(), apps, schema_editor.connection.alias, registered_by="inference.tasks")


class Migration(migrations.Migration):

    dependencies = [
        ("inference", "0007_model_version_is_the_stores"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(register, migrations.RunPython.noop)]
