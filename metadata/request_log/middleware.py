"""Log every authenticated API request (method, path, status, latency) into the partitioned request log.

The raw log is the record. Each logged request is also announced (``request_logged``), so the
operators' views can count it on write without this app knowing them (``ops.request_rollups``
adds it to the per-minute ``api`` rollup). A failure to log never fails the request.

Only a request whose caller was authenticated writes a row. Anything else — no token, a made-up
one (401), a path that names nothing (404) — is counted in ``specops_api_unauthenticated_requests``
(a Prometheus counter, by status) instead: a row for each let anyone fill the table and its
pending list at the speed of the web tier, with no throttle in the way (authentication and the
throttles are a view's, and a path with no view has neither). A request refused by a rate limit
(429) writes no row either. All are still announced, so the rollups count them (one row per
minute).

Rows are written in batches off the request path (``RequestLogWriter``: one multi-row INSERT at
most every ``FLUSH_S`` or ``BATCH_ROWS`` rows, from a thread of its own), not one INSERT and
round trip per request; a process that dies loses at most that interval of rows. A request
handled inside a transaction (a test's, ``ATOMIC_REQUESTS``) writes its row in it instead: the
row may name a tenant that only that transaction can see.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time

from django.db import DatabaseError, connection, connections
from django.dispatch import Signal
from django.utils import timezone
from prometheus_client import Counter

from metadata.models import RequestLog

logger = logging.getLogger(__name__)
LOGGED_PREFIX = "/api/v1/"
UNLOGGED_STATUSES = frozenset({401, 429})  # refused before the view: no row (see above)
FLUSH_S = 0.5
BATCH_ROWS = 500

UNAUTHENTICATED = Counter("specops_api_unauthenticated_requests",
                          "API requests (/api/v1/) without an authenticated caller, by status: counted, not logged.",
                          ["status"])

# Sent after each logged API request (whether or not its row was written), with ``requested_at``
# (aware datetime), ``status_code`` and ``duration_ms``.
request_logged = Signal()


class RequestLogWriter:
    """This process's unwritten rows, inserted together by a daemon thread (started on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[RequestLog] = []
        self._wake = threading.Event()
        self._pid = 0  # the process that started the thread (a fork starts its own)

    def add(self, row: RequestLog) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._start()
            self._pending.append(row)
            full = len(self._pending) >= BATCH_ROWS
        if full:
            self._wake.set()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._pending = []
        threading.Thread(target=self._run, name="specops-request-log", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            self.flush()

    def flush(self) -> int:
        """Insert the pending rows now (one statement per ``BATCH_ROWS``); return how many were written."""
        with self._lock:
            rows, self._pending = self._pending, []
        if not rows:
            return 0
        try:
            RequestLog.objects.bulk_create(rows, batch_size=BATCH_ROWS)
            return len(rows)
        except DatabaseError:
            logger.warning("request log write of %d rows failed", len(rows), exc_info=True)
            return 0
        finally:
            if threading.current_thread().name == "specops-request-log":
                connections.close_all()  # give the pooled connection back between flushes


    def drop_pending(self) -> int:
        """Forget the unwritten rows (a test run whose database is already gone); how many."""
        with self._lock:
            rows, self._pending = self._pending, []
        return len(rows)


writer = RequestLogWriter()
atexit.register(writer.flush)


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
        user = getattr(request, "user", None)
        if not getattr(user, "is_authenticated", False):
            UNAUTHENTICATED.labels(status=str(response.status_code)).inc()
        elif response.status_code not in UNLOGGED_STATUSES:
            membership = getattr(user, "membership", None)
            row = RequestLog(
                requested_at=started_at, method=request.method, path=request.path[:300],
                status_code=response.status_code, duration_ms=duration_ms,
                tenant_id=membership.tenant_id if membership else None,
            )
            if connection.in_atomic_block:
                try:
                    row.save(force_insert=True)
                except DatabaseError:
                    logger.warning("request log write failed", exc_info=True)
            else:
                writer.add(row)
        request_logged.send(sender=RequestLogMiddleware, requested_at=started_at,
                            status_code=response.status_code, duration_ms=duration_ms)
        return response
