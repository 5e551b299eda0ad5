"""Maintenance runs: what an operator started from the admin's Partitions page, and what came of it."""
from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class MaintenanceAction(models.TextChoices):
    ROTATE = "rotate", "rotate now"
    ARCHIVE = "archive", "archive a partition"
    RESTORE = "restore", "restore an archive"


class MaintenanceRunStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"  # another maintenance run held the lock; this one did nothing


class MaintenanceRun(models.Model):
    """One maintenance action an operator started from the admin, run as a Celery job.

    The record of who asked for what and when, and what came of it: the task writes its progress
    (``progress_done`` of ``progress_total`` steps, and the last line it reported) as it goes and
    its result in ``outcome``. ``archival_job_id`` names the ``PartitionArchivalJob`` an archive or
    restore run is about, as a plain number: jobs are truncated with their partitions in tests and
    by hand, and the record of a run must outlive them.
    """

    action = models.CharField(max_length=10, choices=MaintenanceAction.choices)
    target = models.CharField(max_length=500, blank=True, default="")  # a partition, or an archive file
    archival_job_id = models.BigIntegerField(null=True, blank=True)
    options = models.JSONField(default=dict, blank=True)  # e.g. {"attach": true} for a restore
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    requested_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)
    status = models.CharField(max_length=10, choices=MaintenanceRunStatus.choices,
                              default=MaintenanceRunStatus.QUEUED)
    progress_done = models.PositiveIntegerField(default=0)
    progress_total = models.PositiveIntegerField(default=0)
    progress_line = models.TextField(blank=True, default="")
    outcome = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    task_id = models.CharField(max_length=64, blank=True, default="")

    class Meta:
        db_table = "metadata_maintenance_run"
        permissions = [
            ("run_rotation", "Can rotate partitions now from the admin"),
            ("run_archival", "Can archive a partition from the admin"),
            ("run_restore", "Can restore an archive from the admin"),
        ]
        indexes = [models.Index(fields=["-requested_at"], name="maintenance_run_recent")]

    def __str__(self) -> str:
        return f"{self.get_action_display()} {self.target} ({self.status})".replace("  ", " ")
