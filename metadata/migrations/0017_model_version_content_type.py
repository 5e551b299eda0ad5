"""The model version's content type moves to the store with the model, and the permissions with it.

``ModelVersion`` was the inference app's model: its content type (``inference.modelversion``)
carries the permissions staff hold on it (``change_modelversion``: promotion) and the admin's
log of changes. Renaming the content type's app keeps all of them; a database that has no such
content type (a new one: content types are made after ``migrate``) is left alone. Backwards
renames it back.
"""
from django.db import migrations


def _move(apps, schema_editor, source: str, target: str) -> None:
    content_types = apps.get_model("contenttypes", "ContentType").objects.using(schema_editor.connection.alias)
    if content_types.filter(app_label=target, model="modelversion").exists():
        return
    content_types.filter(app_label=source, model="modelversion").update(app_label=target)


def forwards(apps, schema_editor) -> None:
    _move(apps, schema_editor, "inference", "metadata")


def backwards(apps, schema_editor) -> None:
    _move(apps, schema_editor, "metadata", "inference")


class Migration(migrations.Migration):

    dependencies = [
        ("metadata", "0016_tenant_prefix_cache_group"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
