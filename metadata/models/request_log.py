"""The request log: one row per API request, RANGE-partitioned on ``requested_at``.

Written by ``metadata.request_log.RequestLogMiddleware``; the raw record the operators'
API rollups can be rebuilt from (``ops.rollups.backfill_api``).
"""
from __future__ import annotations

import uuid

from django.db import models
from django.utils import timezone

from metadata.models.sessions import Session
from metadata.models.tenants import Tenant


class RequestLog(models.Model):
    """One API request (method, path, status, latency); partitioned by ``requested_at``."""

    pk = models.CompositePrimaryKey("id", "requested_at")
    id = models.UUIDField(default=uuid.uuid4)
    requested_at = models.DateTimeField(default=timezone.now)
    tenant = models.ForeignKey(
        Tenant, null=True, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    method = models.CharField(max_length=8)
    path = models.CharField(max_length=300)
    status_code = models.PositiveSmallIntegerField()
    duration_ms = models.FloatField()
    session = models.ForeignKey(
        Session, null=True, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )

    class Meta:
        db_table = "metadata_request_log"
