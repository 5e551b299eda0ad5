"""Register the rollup job (``specops.roll_up_ops``, every 30 s on the maintenance queue) with beat.

Idempotent by name, like ``metadata.partitions.beat_jobs``: a task that exists (perhaps changed
by an operator since) is left alone; migrating backwards leaves it too (disable it in the admin).
"""
from django.db import migrations
from django.utils import timezone

JOB_NAME = "specops: roll up operational metrics"
TASK = "specops.roll_up_ops"
EVERY_SECONDS = 30


def register(apps, schema_editor):
    using = schema_editor.connection.alias
    task_model = apps.get_model("django_celery_beat", "PeriodicTask")
    if task_model.objects.using(using).filter(name=JOB_NAME).exists():
        return
    interval_model = apps.get_model("django_celery_beat", "IntervalSchedule")
    interval, _ = interval_model.objects.using(using).get_or_create(every=EVERY_SECONDS, period="seconds")
    task_model.objects.using(using).create(
        name=JOB_NAME, task=TASK, interval=interval, queue="maintenance",
        description="Registered by migration metadata 0007; the admin dashboard reads what it writes. Edit freely.")
    # tell a running beat to reload its schedule (signals do not fire on historical models)
    apps.get_model("django_celery_beat", "PeriodicTasks").objects.using(using).update_or_create(
        ident=1, defaults={"last_update": timezone.now()})


class Migration(migrations.Migration):

    dependencies = [
        ("metadata", "0006_ops_rollup"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(register, migrations.RunPython.noop)]
