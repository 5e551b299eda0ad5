"""The serving app's own rows: the losslessness canary's mismatches and generation POSTs' idempotency keys.

The model registry's rows are the store's (``metadata.models.ModelVersion``); ``ModelVersion``
and ``VersionStatus`` are named here too because the device's batching loop reads them from here.
"""
from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from metadata.models import ModelVersion, VersionStatus

__all__ = ["CanaryMismatch", "IdempotencyKey", "ModelVersion", "VersionStatus"]


class CanaryMismatch(models.Model):
    """A finished generation whose target-only replay gave other tokens: speculation was not lossless.

    Written by the losslessness canary (``inference.canary``) and never dropped: each row names the
    session, its model and drafter, both token lists and texts, and the first position they differ.
    """

    session_id = models.UUIDField(db_index=True)
    session_created_at = models.DateTimeField()
    model = models.CharField(max_length=160, help_text="The target, as name:version.")
    drafter = models.CharField(max_length=16)
    first_difference = models.PositiveIntegerField(help_text="The first position where the two outputs differ.")
    served_tokens = models.JSONField(default=list)
    replayed_tokens = models.JSONField(default=list)
    served_text = models.TextField(blank=True, default="")
    replayed_text = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "losslessness canary mismatch"

    def __str__(self) -> str:
        return f"{self.model} {self.drafter} session {self.session_id} @ {self.first_difference}"


class IdempotencyKey(models.Model):
    """A generation POST's ``Idempotency-Key``: the session its first try made (``inference.idempotency``).

    One row per (user, key) while it lives (``expires_at``); the unique constraint is what lets
    concurrent retries race: one claims the key, the others find it. Not partitioned: rows live
    a day (``IDEMPOTENCY_KEY_TTL_S``) and the reconciler deletes them past that, so the table
    holds a day of keyed requests whatever the traffic has been. The session is named by id (its
    table is partitioned; the id carries its creation time).
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64, help_text="SHA-256 of the endpoint and the body.")
    claim = models.UUIDField(help_text="The request that holds the key (a takeover gets a new one).")
    session_id = models.UUIDField(null=True, blank=True)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "key"], name="idempotency_key_per_user")]
        indexes = [models.Index(fields=["expires_at"], name="idempotency_key_expiry")]

    def __str__(self) -> str:
        return f"{self.key} (user {self.user_id})"
