"""Register this app's beat jobs (``ops.tasks.periodic_jobs``): the gauges every minute, the rollups every 30 s.

Idempotent by job name (``core.beat_jobs``): a database that has them already (the store's
migrations registered them before this app registered its own) keeps them as an operator left
them. A job still naming the tasks by their names before they were this app's
(``specops.sample_ops_metrics``, ``specops.roll_up_ops``) is pointed at them. Migrating backwards
leaves them (disable them in the admin).
"""
from django.db import migrations
from django.utils import timezone

FORMER_NAMES = {"specops.sample_ops_metrics": "ops.sample_ops_metrics", "specops.roll_up_ops": "ops.roll_up_ops"}


def register(apps, schema_editor):
    from core.beat_jobs import register_jobs
    from ops.tasks import periodic_jobs

    using = schema_editor.connection.alias
    task_model = apps.get_model("django_celery_beat", "PeriodicTask")
    renamed = sum(task_model.objects.using(using).filter(task=old).update(task=new) for old, new in FORMER_NAMES.items())
    if renamed:  # tell a running beat to reload its schedule (signals do not fire on historical models)
        apps.get_model("django_celery_beat", "PeriodicTasks").objects.using(using).update_or_create(
            ident=1, defaults={"last_update": timezone.now()})
    register_jobs(periodic_jobs(), apps, using, registered_by="ops.tasks")


class Migration(migrations.Migration):

    dependencies = [
        ("ops", "0001_initial"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(register, migrations.RunPython.noop)]
