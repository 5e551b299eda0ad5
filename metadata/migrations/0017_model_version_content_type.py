"""The model version's content type moves to the store with the model, and the permissions with it.

``ModelVersion`` was the inference app's model: its content type (``inference.modelversion``)
carries the permissions staff hold on it (``change_modelversion``: promotion) and the admin's
log of changes. Renaming the content type's app keeps all of them (a content type ``migrate``
made for the model's new app meanwhile is merged into it: `_move`); a database that has no such
content type (a new one: content types are made after ``migrate``) is left alone. Backwards
renames it back.
"""
from django.conf import settings
from django.db import migrations


def _move(apps, schema_editor, source: str, target: str) -> None:
    """Rename ``source``'s content type of the model version to ``target``, keeping its id.

    ``target`` may have one already: the ``post_migrate`` of a ``migrate`` that ran while the model
    was in ``target``'s state makes it (a database migrated back past this migration and forward
    again: a rolled-back deploy). Its grants and log entries move to the old one, which is kept
    (its id is what the rest of the database points at), and the new one goes.
    """
    db = schema_editor.connection.alias
    content_types = apps.get_model("contenttypes", "ContentType").objects.using(db)
    old = content_types.filter(app_label=source, model="modelversion").first()
    if old is None:
        return  # a new database: content types are made after migrate
    made = content_types.filter(app_label=target, model="modelversion").first()
    if made is not None:
        _merge_into(apps, db, made.pk, old.pk)
        content_types.filter(pk=made.pk).delete()
    content_types.filter(pk=old.pk).update(app_label=target)


def _merge_into(apps, db: str, made: int, kept: int) -> None:
    """Move content type ``made``'s permissions (with their user and group grants) and admin log
    entries to content type ``kept``."""
    permissions = apps.get_model("auth", "Permission").objects.using(db)
    grants = [(apps.get_model(settings.AUTH_USER_MODEL).user_permissions.through, "user_id"),
              (apps.get_model("auth", "Group").permissions.through, "group_id")]
    for permission in list(permissions.filter(content_type_id=made)):
        twin = permissions.filter(content_type_id=kept, codename=permission.codename).first()
        if twin is None:
            permissions.filter(pk=permission.pk).update(content_type_id=kept)
            continue
        for through, holder in grants:
            rows = through.objects.using(db)
            held = set(rows.filter(permission_id=twin.pk).values_list(holder, flat=True))
            for owner in rows.filter(permission_id=permission.pk).values_list(holder, flat=True):
                if owner not in held:
                    rows.create(**{holder: owner, "permission_id": twin.pk})
            rows.filter(permission_id=permission.pk).delete()
        permissions.filter(pk=permission.pk).delete()
    apps.get_model("admin", "LogEntry").objects.using(db).filter(content_type_id=made).update(content_type_id=kept)


def forwards(apps, schema_editor) -> None:
    _move(apps, schema_editor, "inference", "metadata")


def backwards(apps, schema_editor) -> None:
    _move(apps, schema_editor, "metadata", "inference")


class Migration(migrations.Migration):

    dependencies = [
        ("metadata", "0016_tenant_prefix_cache_group"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("admin", "0003_logentry_add_action_flag_choices"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
