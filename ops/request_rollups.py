"""API requests rolled up on write: the ``api`` series of the operators' rollups (``OpsRollup``).

Every logged API request (the ``request_logged`` signal of ``metadata.request_log``) is
added to its per-minute rollup, one row per minute and status class with a mergeable latency
histogram: counted in memory and flushed to the database at most every ``ROLLUP_FLUSH_S`` as one
upsert that *adds* to the stored counts, so processes never contend on a row per request, and a
process that dies loses at most that interval of counts (the raw log keeps every request;
``ops.rollups.backfill_api`` rebuilds minutes from it).
"""
from __future__ import annotations

import logging
import threading
import time
from datetime import datetime

from django.db import DatabaseError, connection
from django.utils import timezone

from core.histograms import N_BUCKETS, bucket_of
from ops.models import OpsRollup, RollupWidth

logger = logging.getLogger(__name__)
ROLLUP_FLUSH_S = 2.0
API_SERIES = "api"

_ADD_SQL = f"""
    INSERT INTO {OpsRollup._meta.db_table} AS r (start, width, series, key, count, total, buckets, values, updated_at)
    VALUES {{rows}}
    ON CONFLICT (width, series, key, start) DO UPDATE SET
        count = r.count + EXCLUDED.count,
        total = r.total + EXCLUDED.total,
        buckets = ARRAY(SELECT coalesce(a, 0) + coalesce(b, 0)
                        FROM unnest(r.buckets, EXCLUDED.buckets) WITH ORDINALITY AS t(a, b, i) ORDER BY i),
        updated_at = EXCLUDED.updated_at"""


def status_class(status_code: int) -> str:
    return f"{status_code // 100}xx"


class RequestRollupBuffer:
    """This process's not-yet-flushed counts: (minute, status class) -> count, total ms, buckets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[datetime, str], list] = {}
        self._last_flush = time.monotonic()

    def add(self, requested_at: datetime, status_code: int, duration_ms: float) -> None:
        slot = (requested_at.replace(second=0, microsecond=0), status_class(status_code))
        with self._lock:
            entry = self._pending.get(slot)
            if entry is None:
                entry = self._pending[slot] = [0, 0.0, [0] * N_BUCKETS]
            entry[0] += 1
            entry[1] += duration_ms
            entry[2][bucket_of(duration_ms)] += 1

    def due(self) -> bool:
        return bool(self._pending) and time.monotonic() - self._last_flush >= ROLLUP_FLUSH_S

    def flush(self) -> int:
        """Add the pending counts to the stored rollups; return the rows written (kept on failure)."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._last_flush = time.monotonic()
        if not pending:
            return 0
        slots = sorted(pending)  # one order for every process: no deadlock between two flushes
        params: list = []
        now = timezone.now()
        for start, key in slots:
            count, total, buckets = pending[(start, key)]
            params += [start, RollupWidth.MINUTE, API_SERIES, key, count, total, buckets, "{}", now]
        rows = ", ".join(["(%s, %s, %s, %s, %s, %s, %s::bigint[], %s::jsonb, %s)"] * len(slots))
        try:
            with connection.cursor() as cursor:
                cursor.execute(_ADD_SQL.format(rows=rows), params)
        except DatabaseError:
            logger.warning("request rollup flush failed; keeping the counts for the next one", exc_info=True)
            self._merge_back(pending)
            return 0
        return len(slots)

    def _merge_back(self, pending: dict) -> None:
        with self._lock:
            for slot, (count, total, buckets) in pending.items():
                entry = self._pending.setdefault(slot, [0, 0.0, [0] * N_BUCKETS])
                entry[0] += count
                entry[1] += total
                entry[2] = [a + b for a, b in zip(entry[2], buckets)]


rollup_buffer = RequestRollupBuffer()


def add_logged_request(sender: object, requested_at: datetime, status_code: int, duration_ms: float,
                       **kwargs: object) -> None:
    """Receiver of ``request_logged`` (connected by ``OpsConfig.ready``): count it, flush when due."""
    rollup_buffer.add(requested_at, status_code, duration_ms)
    if rollup_buffer.due():
        rollup_buffer.flush()
