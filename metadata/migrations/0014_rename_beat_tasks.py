"""The cache stats job registered under a task name that named no module runs its task.

``metadata.cache_tasks.snapshot_cache_stats`` named a module that never existed. Only the
``task`` of an existing periodic task changes (name, interval, queue and whatever an operator
edited stay); backwards restores the old name. The ops app points its own jobs at its tasks
(ops migration 0002).
"""
from django.db import migrations
from django.utils import timezone

RENAMED = {
    "metadata.cache_tasks.snapshot_cache_stats": "metadata.cache.snapshot_cache_stats",
}


def _rename(apps, schema_editor, names: dict[str, str]) -> None:
    using = schema_editor.connection.alias
    task_model = apps.get_model("django_celery_beat", "PeriodicTask")
    changed = sum(task_model.objects.using(using).filter(task=old).update(task=new) for old, new in names.items())
    if changed:  # tell a running beat to reload its schedule (signals do not fire on historical models)
        apps.get_model("django_celery_beat", "PeriodicTasks").objects.using(using).update_or_create(
            ident=1, defaults={"last_update": timezone.now()})


def forwards(apps, schema_editor) -> None:
    _rename(apps, schema_editor, RENAMED)


def backwards(apps, schema_editor) -> None:
    _rename(apps, schema_editor, {new: old for old, new in RENAMED.items()})


class Migration(migrations.Migration):

    dependencies = [
        ("metadata", "0013_ops_rollup_moves_to_ops"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
