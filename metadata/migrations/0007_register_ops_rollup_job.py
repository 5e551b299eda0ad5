"""Nothing since the rollup job became the ops app's to register (ops migration 0002).

Kept so the applied history stays whole: on a database migrated before, this registered the job
under its first task name, which ops migration 0002 points at the ops app's task.
"""
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("metadata", "0006_ops_rollup"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = []
