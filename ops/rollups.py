"""Per-minute and per-hour rollups of what the operators' dashboard shows (``OpsRollup`` rows).

The dashboard reads these rows only: at 1,000 requests/s a day of raw request log is 86 M rows,
and a percentile over them per page view is what this module exists to avoid.

Series (``series`` / ``key``; ``count``, ``total``, ``buckets`` = latency histogram in ms):

* ``api`` / status class: requests, sum of ms, histogram. Written on request-log write
  (``ops.request_rollups``); ``backfill_api`` rebuilds minutes from the raw log.
* ``generation`` / drafter: sessions that ended; ``values``: succeeded, failed, cancelled,
  tokens, steps, drafted, accepted, per-position drafted/accepted lists, draft/verify seconds.
* ``ttft`` and ``itl`` / drafter, ``queue_wait`` / device queue: latency histograms (TTFT from
  the session's creation; ITL one sample per token; queue wait = creation to worker start).
* ``pair`` / "<target id>:<draft id or ->": sessions, drafted, accepted, steps (the registry's
  acceptance of each model pair over time).
* ``batch`` / device queue: sessions, sum and max of the most rows each shared a step with.
* ``prefix`` / device queue: sessions, their prompt tokens, the tokens they adopted from the
  prefix cache (``cached_tokens``) and how many adopted any (``hits``).
* ``cache`` / "<cache>/<tier>": hits, misses, coalesced, from the cache snapshots.
* sampled at each run: ``queue_depth`` / queue (broker), ``replica_lag`` / replica (WAL bytes,
  from LSNs; ``down`` samples), ``db_xacts`` / database alias (transactions since the previous
  sample, from ``pg_stat_database``: where reads went; the primary's include the writes),
  ``default_rows`` / table (rows in the DEFAULT partition).

Aggregated series are recomputed from their sources for the last few minutes on every run
(replaced, so a run twice is a run once); sampled ones add one sample to the current minute. Then
the hours those minutes belong to are re-merged from their minutes. Sessions are found by their
creation time through the ``(tenant, created_at)`` index, ending at most ``SESSION_LOOKBACK``
after they were created (a session queued longer than that before ending is not counted).
A run holds a transaction-scoped advisory lock: two runs never overlap, and a run is all or nothing.
"""
from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone

from core import histograms
from metadata.models import (
    CacheStatsSnapshot,
    RequestLog,
    Session,
    Tenant,
)
from sessions.detail.timings import (
    step_times_from_stream,
    streams_of,
    timings_from_steps,
)
from ops import readings
from ops.models import OpsRollup, RollupWidth

logger = logging.getLogger(__name__)

MINUTE = timedelta(minutes=1)
HOUR = timedelta(hours=1)
REAGGREGATE = timedelta(minutes=3)  # late writes of these minutes are picked up
FIRST_RUN_BACK = timedelta(hours=1)
MAX_SPAN = timedelta(hours=4)  # per run; a longer gap is caught up over the next runs
SESSION_LOOKBACK = timedelta(hours=1)
STREAM_TTL = timedelta(hours=1)  # sessions.streams.token_stream.STREAM_TTL_S
MINUTE_RETENTION = timedelta(days=2)
HOUR_RETENTION = timedelta(days=90)
PROGRESS_SERIES = "_progress"
LOCK_KEY = 0x5350_4F50_524F_4C4C  # "SPOPROLL"
AGGREGATED = ("generation", "ttft", "itl", "queue_wait", "pair", "batch", "cache")


def floor_minute(at: datetime) -> datetime:
    return at.replace(second=0, microsecond=0)


def floor_hour(at: datetime) -> datetime:
    return at.replace(minute=0, second=0, microsecond=0)


@dataclass
class Slot:
    """One rollup row being built."""

    count: int = 0
    total: float = 0.0
    buckets: list[int] | None = None
    values: dict | None = None

    def observe_ms(self, value_ms: float, weight: int = 1) -> None:
        if self.buckets is None:
            self.buckets = histograms.empty()
        self.count += weight
        self.total += value_ms * weight
        histograms.observe(self.buckets, value_ms, weight)

    def add(self, name: str, value) -> None:
        self.values = self.values if self.values is not None else {}
        self.values[name] = merge_value(name, self.values.get(name), value)


def merge_value(name: str, mine, theirs):
    """Additive merge; ``*_max`` and ``cumulative`` by max; lists element-wise."""
    if mine is None:
        return list(theirs) if isinstance(theirs, list) else theirs
    if theirs is None:
        return mine
    if isinstance(mine, list):
        longer, shorter = (mine, theirs) if len(mine) >= len(theirs) else (theirs, mine)
        return [a + (shorter[i] if i < len(shorter) else 0) for i, a in enumerate(longer)]
    if name.endswith("max") or name == "cumulative":
        return max(mine, theirs)
    return mine + theirs


def merge_rows(rows: Iterable) -> Slot:
    """One Slot from several rollup rows of one series and key (minutes into an hour, a window)."""
    merged = Slot()
    buckets: list[int] | None = None
    for row in rows:
        merged.count += row.count
        merged.total += row.total
        if row.buckets:
            if buckets is None:
                buckets = list(row.buckets)
            else:
                buckets = [a + b for a, b in zip(buckets, row.buckets)]
        for name, value in (row.values or {}).items():
            merged.add(name, value)
    merged.buckets = buckets
    return merged


Slots = dict[tuple[str, str, datetime], Slot]


# ------------------------------------------------------------------------- sessions


_SESSION_SQL = f"""
    SELECT id, drafter, queue, status, target_id, draft_id, token_count, created_at, started_at, finished_at,
           stats->>'drafter', (stats->>'steps')::int, (stats->>'drafted')::int, (stats->>'accepted')::int,
           stats->'drafted_per_position', stats->'accepted_per_position',
           (stats->>'draft_seconds')::float, (stats->>'verify_seconds')::float,
           (stats->>'batch_rows_max')::int, (stats->>'ttft_seconds')::float, (stats->>'itl_seconds')::float,
           (stats->>'prompt_tokens')::int, (stats->>'cached_tokens')::int
    FROM {Session._meta.db_table}
    WHERE tenant_id = ANY(%s) AND created_at >= %s AND created_at < %s
      AND finished_at >= %s AND finished_at < %s"""


def aggregate_sessions(start: datetime, end: datetime, slots: Slots, read_streams: bool = True) -> int:
    """Add the sessions that ended in [start, end) to ``slots``; return how many."""
    tenants = list(Tenant.objects.using("default").values_list("pk", flat=True))
    with connection.cursor() as cursor:
        cursor.execute(_SESSION_SQL, [tenants, start - SESSION_LOOKBACK, end, start, end])
        rows = cursor.fetchall()
    recent = [row[0] for row in rows if row[19] is None and row[9] >= timezone.now() - STREAM_TTL]
    streams = _streams(recent) if read_streams else {}
    for row in rows:
        _add_session(row, streams.get(row[0]), slots)
    return len(rows)


def _streams(session_ids: list) -> dict:
    try:
        return streams_of(session_ids)
    except Exception:  # Redis down: these sessions' TTFT/ITL stay unknown
        logger.warning("rollup: token streams unreadable; TTFT/ITL of %d sessions skipped", len(session_ids))
        return {}


def _json_list(raw) -> list | None:
    """A jsonb list from a raw cursor (Django's psycopg loader leaves jsonb as text)."""
    value = json.loads(raw) if isinstance(raw, str) else raw
    return value if isinstance(value, list) else None


def _add_session(row: tuple, stream: list | None, slots: Slots) -> None:
    (_, requested_drafter, queue, status, target_id, draft_id, tokens, created_at, started_at,
     finished_at, drafter, steps, drafted, accepted, drafted_pp, accepted_pp, draft_s, verify_s, batch_rows,
     ttft_s, itl_s, prompt_tokens, cached_tokens) = row
    drafter = drafter or requested_drafter
    drafted_pp, accepted_pp = _json_list(drafted_pp), _json_list(accepted_pp)
    minute = floor_minute(finished_at)
    generation = slots.setdefault(("generation", drafter, minute), Slot())
    generation.count += 1
    generation.add(status, 1)
    generation.add("tokens", tokens or 0)
    for name, value in (("steps", steps), ("drafted", drafted), ("accepted", accepted),
                        ("drafted_per_position", drafted_pp), ("accepted_per_position", accepted_pp),
                        ("draft_seconds", draft_s), ("verify_seconds", verify_s)):
        if value is not None:
            generation.add(name, value)
    if steps:
        pair = slots.setdefault(("pair", f"{target_id}:{draft_id or '-'}", minute), Slot())
        pair.count += 1
        pair.add("steps", steps)
        pair.add("drafted", drafted or 0)
        pair.add("accepted", accepted or 0)
    if prompt_tokens:
        prefix = slots.setdefault(("prefix", queue, minute), Slot())
        prefix.count += 1
        prefix.add("prompt_tokens", prompt_tokens)
        prefix.add("cached_tokens", cached_tokens or 0)
        prefix.add("hits", 1 if cached_tokens else 0)
    if batch_rows:
        batch = slots.setdefault(("batch", queue, minute), Slot())
        batch.count += 1
        batch.total += batch_rows
        batch.add("rows_max", batch_rows)
    if started_at is not None:
        slots.setdefault(("queue_wait", queue, minute), Slot()).observe_ms(
            max((started_at - created_at).total_seconds(), 0.0) * 1000)
    if ttft_s is not None:
        slots.setdefault(("ttft", drafter, minute), Slot()).observe_ms(ttft_s * 1000)
        if itl_s is not None and tokens and tokens > 1:
            slots.setdefault(("itl", drafter, minute), Slot()).observe_ms(itl_s * 1000, tokens - 1)
    elif stream:
        ttft, samples = timings_from_steps(created_at, step_times_from_stream(stream))
        if ttft is not None:
            slots.setdefault(("ttft", drafter, minute), Slot()).observe_ms(ttft * 1000)
        for gap, weight in samples:
            slots.setdefault(("itl", drafter, minute), Slot()).observe_ms(gap * 1000, weight)


# ------------------------------------------------------------------------- caches, samples


def aggregate_cache(start: datetime, end: datetime, slots: Slots) -> None:
    snapshots = CacheStatsSnapshot.objects.using("default").filter(taken_at__gte=start, taken_at__lt=end)
    for snap in snapshots.only("taken_at", "cache", "tier", "hits", "misses", "coalesced"):
        slot = slots.setdefault(("cache", f"{snap.cache}/{snap.tier}", floor_minute(snap.taken_at)), Slot())
        slot.count += snap.hits + snap.misses
        slot.add("hits", snap.hits)
        slot.add("misses", snap.misses)
        slot.add("coalesced", snap.coalesced)


def take_samples(minute: datetime) -> Slots:
    """One sample of each sampled series, for the current minute."""
    slots: Slots = {}
    for name, sampler in (("queue_depth", _queue_depths), ("default_rows", _default_rows),
                          ("replica_lag", _replica_lag), ("db_xacts", _database_transactions)):
        try:
            with transaction.atomic():  # a savepoint: a failed source leaves the run's transaction usable
                sampled = sampler()
            for key, value, extra in sampled:
                slot = slots.setdefault((name, key, minute), Slot())
                slot.count += 1
                slot.total += value
                slot.add("max", value)
                for extra_name, extra_value in extra.items():
                    slot.add(extra_name, extra_value)
        except Exception:  # one source down must not stop the others
            logger.warning("rollup: sampling %s failed", name, exc_info=True)
    return slots


def _queue_depths():
    return [(name, depth, {}) for name, depth in readings.queue_lengths(readings.device_queues()).items()]


def _default_rows():
    return [(table, rows, {}) for table, rows in readings.default_partition_rows().items()]


def _replica_lag():
    return [(alias, float(lag or 0), {"down": 0 if up else 1}) for alias, lag, up in readings.replica_positions()]


def _database_transactions():
    """Cumulative counts; ``_to_deltas`` turns them into transactions since the previous sample."""
    return [(alias, 0.0, {"cumulative": total}) for alias, total in readings.database_transactions().items()]


def _to_deltas(samples: Slots) -> None:
    """Turn each db_xacts sample's cumulative count into transactions since the previous sample."""
    for (series, key, minute), slot in samples.items():
        if series != "db_xacts":
            continue
        previous = (OpsRollup.objects.filter(width=RollupWidth.MINUTE, series=series, key=key,
                                             start__gte=minute - timedelta(minutes=10))
                    .order_by("-start").values_list("values", flat=True).first())
        cumulative = slot.values["cumulative"]
        before = (previous or {}).get("cumulative")
        delta = cumulative - before if before is not None and cumulative >= before else 0
        slot.total = float(delta)
        slot.values["max"] = delta


# ------------------------------------------------------------------------- writing


def _replace(width: int, series: Iterable[str], start: datetime, end: datetime, slots: Slots) -> None:
    OpsRollup.objects.filter(width=width, series__in=list(series), start__gte=start, start__lt=end).delete()
    OpsRollup.objects.bulk_create(_rows(width, slots))


def _rows(width: int, slots: Slots) -> list[OpsRollup]:
    now = timezone.now()
    return [OpsRollup(start=start, width=width, series=series, key=key, count=slot.count, total=slot.total,
                      buckets=slot.buckets or [], values=slot.values or {}, updated_at=now)
            for (series, key, start), slot in sorted(slots.items())]


def _add_samples(slots: Slots) -> None:
    """Add samples into their minute rows (several runs a minute each add one)."""
    for (series, key, start), slot in slots.items():
        row, created = OpsRollup.objects.select_for_update().get_or_create(
            width=RollupWidth.MINUTE, series=series, key=key, start=start,
            defaults={"count": slot.count, "total": slot.total, "values": slot.values or {}})
        if not created:
            merged = merge_rows([row, OpsRollup(count=slot.count, total=slot.total, values=slot.values or {})])
            row.count, row.total, row.values, row.updated_at = merged.count, merged.total, merged.values, timezone.now()
            row.save(update_fields=["count", "total", "values", "updated_at"])


def roll_hours(start: datetime, end: datetime) -> int:
    """Re-merge every hour that [start, end) touches from its minute rows; return the hour rows."""
    first, last = floor_hour(start), floor_hour(end - timedelta(microseconds=1)) + HOUR
    groups: dict[tuple[str, str, datetime], list] = defaultdict(list)
    minutes = OpsRollup.objects.filter(width=RollupWidth.MINUTE, start__gte=first, start__lt=last).exclude(
        series=PROGRESS_SERIES)
    for row in minutes:
        groups[(row.series, row.key, floor_hour(row.start))].append(row)
    slots = {slot_key: merge_rows(rows) for slot_key, rows in groups.items()}
    OpsRollup.objects.filter(width=RollupWidth.HOUR, start__gte=first, start__lt=last).delete()
    OpsRollup.objects.bulk_create(_rows(RollupWidth.HOUR, slots))
    return len(slots)


def watermark() -> datetime | None:
    row = OpsRollup.objects.filter(width=RollupWidth.MINUTE, series=PROGRESS_SERIES).order_by("-start").first()
    return row.start if row else None


def _set_watermark(through: datetime) -> None:
    OpsRollup.objects.filter(series=PROGRESS_SERIES).delete()
    OpsRollup.objects.create(width=RollupWidth.MINUTE, series=PROGRESS_SERIES, start=through)


@dataclass(frozen=True)
class RollupRun:
    start: datetime | None
    end: datetime | None
    sessions: int = 0
    rows: int = 0
    caught_up: bool = True
    skipped: str = ""  # why nothing ran


def aggregate_span(start: datetime, end: datetime, read_streams: bool = True) -> tuple[int, int]:
    """Rebuild the aggregated minute rows of [start, end); return (sessions, rows)."""
    slots: Slots = {}
    sessions = aggregate_sessions(start, end, slots, read_streams=read_streams)
    aggregate_cache(start, end, slots)
    _replace(RollupWidth.MINUTE, AGGREGATED, start, end, slots)
    return sessions, len(slots)


def roll_up(now: datetime | None = None, sample: bool = True) -> RollupRun:
    """One run of the job: see the module docstring."""
    now = now or timezone.now()
    current = floor_minute(now)
    with transaction.atomic(using="default"):
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [LOCK_KEY])
            if not cursor.fetchone()[0]:
                return RollupRun(None, None, skipped="another run holds the lock")
        done = watermark()
        start = max(done - REAGGREGATE, current - MAX_SPAN * 6) if done else current - FIRST_RUN_BACK
        end = min(current + MINUTE, start + MAX_SPAN)
        sessions, rows = aggregate_span(start, end)
        if sample and end > current:
            samples = take_samples(current)
            _to_deltas(samples)
            _add_samples(samples)
            rows += len(samples)
        roll_hours(start, end)
        _set_watermark(min(end, current))
        OpsRollup.objects.filter(width=RollupWidth.MINUTE, start__lt=now - MINUTE_RETENTION).exclude(
            series=PROGRESS_SERIES).delete()
        OpsRollup.objects.filter(width=RollupWidth.HOUR, start__lt=now - HOUR_RETENTION).delete()
    return RollupRun(start, end, sessions=sessions, rows=rows, caught_up=end > current)


# ------------------------------------------------------------------------- backfill from raw rows


_API_BACKFILL_SQL = f"""
    SELECT date_trunc('minute', requested_at), (status_code / 100)::text || 'xx',
           width_bucket(duration_ms, %s::float8[]), count(*), sum(duration_ms)
    FROM {RequestLog._meta.db_table} WHERE requested_at >= %s AND requested_at < %s GROUP BY 1, 2, 3"""


def backfill_api(start: datetime, end: datetime) -> int:
    """Rebuild the ``api`` minutes of [start, end) from the raw request log (replacing them).

    For requests that never went through the middleware's rollup (a bench, an imported log); a
    scan of the raw rows, so run it over closed minutes, in chunks, never per page view.
    """
    slots: Slots = {}
    with connection.cursor() as cursor:
        cursor.execute(_API_BACKFILL_SQL, [[float(edge) for edge in histograms.EDGES_MS], start, end])
        for minute, key, bucket, count, total in cursor.fetchall():
            slot = slots.setdefault(("api", key, minute), Slot(buckets=histograms.empty()))
            slot.count += count
            slot.total += total
            slot.buckets[bucket] += count
    with transaction.atomic():
        _replace(RollupWidth.MINUTE, ["api"], start, end, slots)
        roll_hours(start, end)
    return len(slots)
