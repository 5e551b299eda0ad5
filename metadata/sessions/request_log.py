"""Log every API request (method, path, status, latency) into the partitioned request log.

The raw log is the record. Each logged request is also announced (``request_logged``), so the
operators' views can count it on write without this app knowing them (``ops.request_rollups``
adds it to the per-minute ``api`` rollup). A failure to log never fails the request.
"""
from __future__ import annotations

import logging
import time

from django.db import DatabaseError
from django.dispatch import Signal
from django.utils import timezone

from metadata.models import RequestLog

logger = logging.getLogger(__name__)
LOGGED_PREFIX = "/api/v1/"

# Sent after each logged API request (whether or not its row was written), with ``requested_at``
# (aware datetime), ``status_code`` and ``duration_ms``.
request_logged = Signal()


class RequestLogMiddleware:
    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request):
        if not request.path.startswith(LOGGED_PREFIX):
            return self.get_response(request)
        started_at, started = timezone.now(), time.perf_counter()
        response = self.get_response(request)
        if response.streaming:  # a stream's duration is its lifetime, not a latency
            return response
        duration_ms = (time.perf_counter() - started) * 1000
        membership = getattr(getattr(request, "user", None), "membership", None)
        try:
            RequestLog.objects.create(
                requested_at=started_at, method=request.method, path=request.path[:300],
                status_code=response.status_code, duration_ms=duration_ms,
                tenant_id=membership.tenant_id if membership else None,
            )
        except DatabaseError:
            logger.warning("request log write failed", exc_info=True)
        request_logged.send(sender=RequestLogMiddleware, requested_at=started_at,
                            status_code=response.status_code, duration_ms=duration_ms)
        return response
