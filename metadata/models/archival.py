"""Partition archival jobs: one partition's resumable way to cold storage (``metadata.archival``)."""
from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.utils import timezone


class ArchivalStep(models.TextChoices):
    PENDING = "pending"
    DETACHED = "detached"
    EXPORTED = "exported"
    VERIFIED = "verified"
    DROPPED = "dropped"
    FAILED = "failed"


class PartitionArchivalJob(models.Model):
    """One partition's way to cold storage; a crash resumes from ``step`` on the next run."""

    parent_table = models.CharField(max_length=63)
    partition = models.CharField(max_length=63)
    range_start = models.DateTimeField()
    range_end = models.DateTimeField()
    step = models.CharField(max_length=10, choices=ArchivalStep.choices, default=ArchivalStep.PENDING)
    # The table's OID when the job was made: a later table reusing the name is not this one.
    relation_oid = models.PositiveBigIntegerField(null=True, blank=True)
    archive_path = models.CharField(max_length=500, blank=True, default="")
    archive_sha256 = models.CharField(max_length=64, blank=True, default="")
    archive_bytes = models.BigIntegerField(null=True, blank=True)
    row_count = models.BigIntegerField(null=True, blank=True)
    checksum = models.CharField(max_length=64, blank=True, default="")  # rows, see archive_files
    error = models.TextField(blank=True, default="")
    failed_step = models.CharField(max_length=10, blank=True, default="")
    attempts = models.PositiveIntegerField(default=0)  # failed attempts so far
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            # A name can come back (a drained or restored range), so only one *unfinished* job.
            models.UniqueConstraint(
                fields=["parent_table", "partition"],
                condition=~Q(step="dropped"),
                name="one_open_archival_job_per_partition",
            )
        ]
        indexes = [models.Index(fields=["step", "range_start"], name="archival_job_by_step")]

    def __str__(self) -> str:
        return f"{self.partition} ({self.step})"
