"""Sessions: one generation each, its request, state and outcome. RANGE-partitioned on ``created_at``.

A session's id is a UUIDv7 of its ``created_at`` (``metadata.ids``): every lookup by id
through ``Session.objects`` adds the partition key the id carries, so PostgreSQL reads one
partition (``metadata.session_keys``).
"""
from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from metadata.ids import uuid7
from metadata.models.model_versions import ModelVersion
from metadata.models.tenants import Tenant
from metadata.session_keys import SessionQuerySet, matching_id_and_time


class SessionStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


LIVE_STATUSES = (SessionStatus.QUEUED, SessionStatus.RUNNING)


class Session(models.Model):
    """One generation: its request, its state, and its outcome. Partitioned by ``created_at``.

    The id and ``created_at`` are made together: a new session's id is the UUIDv7 of its
    ``created_at`` (to the millisecond; given or now), and a session given a UUIDv7 id takes
    its time as ``created_at``. Ids of version 4 (sessions made before UUIDv7) keep working.
    """

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="sessions")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    last_activity_at = models.DateTimeField(default=timezone.now)
    status = models.CharField(max_length=16, choices=SessionStatus.choices, default=SessionStatus.QUEUED)
    target = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="+")
    draft = models.ForeignKey(ModelVersion, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    drafter = models.CharField(max_length=16)
    queue = models.CharField(max_length=32)
    prompt = models.TextField()
    prompt_tokens = models.PositiveIntegerField()
    params = models.JSONField(default=dict)
    token_count = models.PositiveIntegerField(default=0)
    text = models.TextField(blank=True, default="")
    finish_reason = models.CharField(max_length=16, blank=True, default="")
    error = models.TextField(blank=True, default="")
    stats = models.JSONField(default=dict, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Crash safety: a worker claims a session by taking its lease (status running, lease in the
    # future) and renews it while the session is in its batch; an expired lease means the worker
    # died, and the reconciler re-enqueues the session. attempts counts claims (runs and resumes).
    attempts = models.PositiveSmallIntegerField(default=0)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    worker = models.CharField(max_length=128, blank=True, default="")
    # When a task for it was last handed to the broker (submission, or the reconciler when the
    # broker may have lost it): a session queued long after this gets another task.
    enqueued_at = models.DateTimeField(null=True, blank=True)

    objects = SessionQuerySet.as_manager()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args:  # made in code; rows loaded from the database come positionally (Model.from_db)
            kwargs = matching_id_and_time(kwargs)
        super().__init__(*args, **kwargs)

    class Meta:
        base_manager_name = "objects"
        indexes = [
            # The hottest read, state by session id, served by an index-only scan.
            models.Index(
                fields=["id"],
                include=["status", "token_count", "updated_at", "tenant"],
                name="session_state_covering",
            ),
            # Live sessions only: a small index that stays small as finished sessions pile up.
            models.Index(
                fields=["last_activity_at"],
                condition=Q(status__in=[s.value for s in LIVE_STATUSES]),
                name="session_live_partial",
            ),
            models.Index(fields=["tenant", "-created_at", "id"], name="session_tenant_recent"),
        ]

    def __str__(self) -> str:
        return str(self.id)
