"""Maintenance runs: each "rotate now", "archive this partition" and "restore this archive" an
operator starts from the admin's Partitions page, with who asked, when, its progress and outcome;
and the permissions that allow each action (``metadata.run_rotation``, ``run_archival``,
``run_restore``).
"""
import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("metadata", "0010_session_reconciler"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="MaintenanceRun",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("action", models.CharField(choices=[("rotate", "rotate now"), ("archive", "archive a partition"),
                                                     ("restore", "restore an archive")], max_length=10)),
                ("target", models.CharField(blank=True, default="", max_length=500)),
                ("archival_job_id", models.BigIntegerField(blank=True, null=True)),
                ("options", models.JSONField(blank=True, default=dict)),
                ("requested_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("started_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                ("updated_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("status", models.CharField(choices=[("queued", "Queued"), ("running", "Running"),
                                                     ("succeeded", "Succeeded"), ("failed", "Failed"),
                                                     ("skipped", "Skipped")], default="queued", max_length=10)),
                ("progress_done", models.PositiveIntegerField(default=0)),
                ("progress_total", models.PositiveIntegerField(default=0)),
                ("progress_line", models.TextField(blank=True, default="")),
                ("outcome", models.JSONField(blank=True, default=dict)),
                ("error", models.TextField(blank=True, default="")),
                ("task_id", models.CharField(blank=True, default="", max_length=64)),
                ("requested_by", models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL,
                                                   related_name="+", to=settings.AUTH_USER_MODEL)),
            ],
            options={
                "db_table": "metadata_maintenance_run",
                "permissions": [("run_rotation", "Can rotate partitions now from the admin"),
                                ("run_archival", "Can archive a partition from the admin"),
                                ("run_restore", "Can restore an archive from the admin")],
                "indexes": [models.Index(fields=["-requested_at"], name="maintenance_run_recent")],
            },
        ),
    ]
