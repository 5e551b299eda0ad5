"""The numbers behind the operators' dashboard, read from the rollups only (``ops.rollups``).

Two windows: the last hour by minute (the live charts) and the last day by hour. Each is one
indexed range read of ``OpsRollup`` (about 20 series x 60 or 24 rows), never a scan of the raw
request log or of a day of sessions; the few other reads (live sessions through their partial
index, open archival jobs, active models) are small by construction.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple

from django.db import connection
from django.utils import timezone

from core import histograms
from core.charts import PALETTE, Reference, Series, bar_chart, line_chart
from core.conf import conf
from metadata.models import ModelVersion, VersionStatus
from inference.worker import compile_reading, prefix_cache_reading
from inference.worker.metrics import ITL_SLO_SECONDS, TTFT_SLO_SECONDS
from metadata.models import (
    LIVE_STATUSES,
    ArchivalStep,
    PartitionArchivalJob,
    Session,
)
from ops.models import OpsRollup, RollupWidth
from ops.rollups import (
    PROGRESS_SERIES,
    Slot,
    floor_hour,
    floor_minute,
    merge_rows,
)

LIVE_MINUTES = 60
DAY_HOURS = 24
STALE_AFTER = timedelta(minutes=2)  # the job runs every 30 s
ARCHIVAL_STEPS = [ArchivalStep.PENDING, ArchivalStep.DETACHED, ArchivalStep.EXPORTED, ArchivalStep.VERIFIED,
                  ArchivalStep.DROPPED]


_WINDOW_SQL = (f"SELECT start, series, key, count, total, buckets, values::text FROM {OpsRollup._meta.db_table} "
               "WHERE width = %s AND start >= %s AND start <= %s AND series <> %s")


class Row(NamedTuple):
    start: datetime
    series: str
    key: str
    count: int
    total: float
    buckets: list
    values: dict


class RollupWindow:
    """The rollup rows of one window: ``(series, key) -> {start: row}`` over fixed slot starts.

    Merged slots are memoized: several charts read the same series.
    """

    def __init__(self, width: int, starts: list[datetime], rows) -> None:
        self.width, self.starts = width, starts
        self.rows: dict[tuple[str, str], dict[datetime, Row]] = defaultdict(dict)
        self._keys: dict[str, list[str]] = defaultdict(list)
        for row in rows:
            if (row.series, row.key) not in self.rows:
                self._keys[row.series].append(row.key)
            self.rows[(row.series, row.key)][row.start] = row
        self._merged: dict[tuple, Slot] = {}

    @classmethod
    def load(cls, width: int, slots: int, now: datetime) -> RollupWindow:
        last = floor_minute(now) if width == RollupWidth.MINUTE else floor_hour(now)
        step = timedelta(minutes=width)
        starts = [last - step * i for i in range(slots - 1, -1, -1)]
        # A plain cursor: a thousand rows through the ORM cost more than the query (values is
        # decoded only where a series has any).
        with connection.cursor() as cursor:
            cursor.execute(_WINDOW_SQL, [width, starts[0], last, PROGRESS_SERIES])
            rows = [Row(start, series, key, count, total, buckets, json.loads(values) if values != "{}" else {})
                    for start, series, key, count, total, buckets, values in cursor.fetchall()]
        return cls(width, starts, rows)

    def keys(self, series: str) -> list[str]:
        return sorted(self._keys.get(series, ()))

    def slot(self, series: str, start: datetime, key: str | None = None) -> Slot:
        memo = (series, start, key)
        if memo not in self._merged:
            keys = [key] if key is not None else self.keys(series)
            self._merged[memo] = merge_rows(row for k in keys if (row := self.rows[(series, k)].get(start)) is not None)
        return self._merged[memo]

    def total(self, series: str, key: str | None = None) -> Slot:
        memo = (series, None, key)
        if memo not in self._merged:
            keys = [key] if key is not None else self.keys(series)
            self._merged[memo] = merge_rows(row for k in keys for row in self.rows[(series, k)].values())
        return self._merged[memo]

    def label(self, start: datetime) -> str:
        return start.strftime("%H:%M")

    def points(self, series: str, value, key: str | None = None) -> list[tuple[str, float | None]]:
        """One point per slot: ``value(slot)`` of the merged rows (all keys unless ``key``)."""
        return [(self.label(start), value(self.slot(series, start, key))) for start in self.starts]


# ------------------------------------------------------------------------- derived values


def quantile_of(q: float):
    return lambda slot: histograms.quantile(slot.buckets, q) if slot.buckets and slot.count else None


def value_of(name: str, default=None):
    return lambda slot: (slot.values or {}).get(name, default)


def acceptance(slot: Slot) -> float | None:
    values = slot.values or {}
    return values["accepted"] / values["drafted"] if values.get("drafted") else None


def mean_accepted_length(slot: Slot) -> float | None:
    values = slot.values or {}
    return (values.get("accepted", 0) + values["steps"]) / values["steps"] if values.get("steps") else None


def hit_rate(slot: Slot) -> float | None:
    values = slot.values or {}
    total = values.get("hits", 0) + values.get("misses", 0)
    return 100.0 * values["hits"] / total if total else None


def reused_share(slot: Slot) -> float | None:
    """Percent of the sessions' prompt tokens adopted from the prefix cache."""
    values = slot.values or {}
    return 100.0 * values.get("cached_tokens", 0) / values["prompt_tokens"] if values.get("prompt_tokens") else None


def prefix_hit_rate(slot: Slot) -> float | None:
    """Percent of the sessions that adopted a cached prefix."""
    return 100.0 * (slot.values or {}).get("hits", 0) / slot.count if slot.count else None


def mean(slot: Slot) -> float | None:
    return slot.total / slot.count if slot.count else None


# ------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class DrafterRow:
    drafter: str
    sessions: int
    tokens: int
    acceptance: float | None
    mean_accepted_length: float | None
    ttft_p95_ms: float | None
    itl_p95_ms: float | None


def _colored(key_series: list[tuple[str, list]]) -> list[Series]:
    return [Series(label, points, PALETTE[i % len(PALETTE)]) for i, (label, points) in enumerate(key_series)]


def throughput_charts(live: RollupWindow) -> dict:
    per_minute = live.points("generation", lambda s: float(s.count))
    tok_s = live.points("generation", lambda s: (s.values or {}).get("tokens", 0) / 60.0)
    return {
        "generations_chart": bar_chart(Series("generations per minute", per_minute), "/min",
                                       title="Generations per minute (all drafters)"),
        "tokens_chart": line_chart([Series("tokens/s", tok_s, PALETTE[2])], "tok/s",
                                   title="Aggregate generated tokens per second"),
    }


def latency_charts(live: RollupWindow, day: RollupWindow) -> dict:
    ttft = [Series("TTFT p50", live.points("ttft", quantile_of(0.5))),
            Series("TTFT p95", live.points("ttft", quantile_of(0.95)), PALETTE[1])]
    itl = [Series("ITL p50", live.points("itl", quantile_of(0.5))),
           Series("ITL p95", live.points("itl", quantile_of(0.95)), PALETTE[1])]
    api = [Series("API p95", live.points("api", quantile_of(0.95))),
           Series("API p99", live.points("api", quantile_of(0.99)), PALETTE[1])]
    api_day = Series("API p95 per hour", day.points("api", quantile_of(0.95)))
    return {
        "ttft_chart": line_chart(ttft, "ms", reference=Reference(f"SLO p95 {TTFT_SLO_SECONDS * 1000:g} ms",
                                                                 TTFT_SLO_SECONDS * 1000),
                                 title="Time to first token"),
        "itl_chart": line_chart(itl, "ms", reference=Reference(f"SLO p95 {ITL_SLO_SECONDS * 1000:g} ms",
                                                               ITL_SLO_SECONDS * 1000),
                                title="Inter-token latency"),
        "api_chart": line_chart(api, "ms", reference=Reference(f"SLO p95 {conf.SLO_P95_MS:g} ms", conf.SLO_P95_MS),
                                title="API latency (per minute)"),
        "api_day_chart": bar_chart(api_day, "ms", Reference(f"SLO p95 {conf.SLO_P95_MS:g} ms", conf.SLO_P95_MS),
                                   title="API p95 per hour, last 24 h"),
        "latency_rows": latency_rows(day),
    }


def latency_rows(day: RollupWindow) -> list[dict]:
    rows = []
    for start in day.starts:
        slot = day.slot("api", start)
        if not slot.count:
            continue
        errors = day.slot("api", start, "5xx").count
        rows.append({"hour": start, "requests": slot.count, "p50": histograms.quantile(slot.buckets, 0.5),
                     "p95": histograms.quantile(slot.buckets, 0.95), "p99": histograms.quantile(slot.buckets, 0.99),
                     "errors": errors, "over_slo": (histograms.quantile(slot.buckets, 0.95) or 0) > conf.SLO_P95_MS})
    return rows


def batching_charts(live: RollupWindow) -> dict:
    queues = sorted(set(live.keys("batch")) | set(live.keys("queue_depth")))
    rows = _colored([(f"{q} mean rows", live.points("batch", mean, q)) for q in live.keys("batch")]
                    + [(f"{q} max rows", live.points("batch", value_of("rows_max"), q)) for q in live.keys("batch")])
    depth = _colored([(q, live.points("queue_depth", value_of("max"), q)) for q in live.keys("queue_depth")])
    return {
        "device_queues": queues,
        "batch_chart": line_chart(rows, "rows", title="Batch rows per device queue (sessions sharing a step)"),
        "queue_chart": line_chart(depth, "msgs", title="Queue depth (messages waiting, max per minute)"),
    }


def drafter_rows(window: RollupWindow) -> list[DrafterRow]:
    out = []
    for drafter in window.keys("generation"):
        slot = window.total("generation", drafter)
        ttft, itl = window.total("ttft", drafter), window.total("itl", drafter)
        out.append(DrafterRow(drafter, slot.count, (slot.values or {}).get("tokens", 0), acceptance(slot),
                              mean_accepted_length(slot),
                              histograms.quantile(ttft.buckets, 0.95) if ttft.buckets else None,
                              histograms.quantile(itl.buckets, 0.95) if itl.buckets else None))
    return out


def acceptance_charts(live: RollupWindow, day: RollupWindow) -> dict:
    per_drafter = _colored([(d, live.points("generation", lambda s: _pct(acceptance(s)), d))
                            for d in live.keys("generation")])
    positions = []
    for drafter in day.keys("generation"):
        values = day.total("generation", drafter).values or {}
        drafted, accepted = values.get("drafted_per_position") or [], values.get("accepted_per_position") or []
        if drafted:
            points = [(f"{i + 1}", 100.0 * a / d if d else None) for i, (d, a) in enumerate(zip(drafted, accepted))]
            positions.append({"drafter": drafter, "chart": bar_chart(
                Series(f"{drafter}: P(accepted | drafted) by draft position", points), "%", top=100.0,
                title="per-position acceptance, last 24 h")})
    return {
        "acceptance_chart": line_chart(per_drafter, "%", top=100.0, title="Acceptance rate per drafter"),
        "position_charts": positions,
        "drafters_hour": drafter_rows(live),
        "drafters_day": drafter_rows(day),
    }


def _pct(value: float | None) -> float | None:
    return None if value is None else 100.0 * value


def cache_and_replica_charts(live: RollupWindow) -> dict:
    caches = _colored([(key, live.points("cache", hit_rate, key)) for key in live.keys("cache")])
    lag = _colored([(key, live.points("replica_lag", value_of("max"), key)) for key in live.keys("replica_lag")])
    reads = _colored([(key, live.points("db_xacts", lambda s: s.total if s.count else None, key))
                      for key in live.keys("db_xacts")])
    return {
        "cache_chart": line_chart(caches, "%", top=100.0, title="Cache hit rate per cache and tier"),
        "replica_lag_chart": line_chart(lag, "B", title="Replica lag (WAL bytes not replayed, max per minute)"),
        "reads_chart": line_chart(reads, "tx/min", title="Where queries went: transactions per server"),
    }


def prefix_cache_charts(live: RollupWindow) -> dict:
    """The prefix cache: per device queue, the share of prompt tokens reused and of sessions that
    adopted a prefix (from the sessions' stats); each live device's memory (its Redis reading)."""
    lines = []
    for key in live.keys("prefix"):
        lines.append((f"{key} tokens reused", live.points("prefix", reused_share, key)))
        lines.append((f"{key} sessions hit", live.points("prefix", prefix_hit_rate, key)))
    try:
        devices = prefix_cache_reading.readings()
    except Exception:  # Redis down: the chart still shows, the table says it cannot read
        devices = None
    return {"prefix_chart": line_chart(_colored(lines), "%", top=100.0,
                                       title="Prefix cache: prompt tokens reused and sessions that hit"),
            "prefix_devices": devices}


def compiled_forwards() -> dict:
    """Each live device's models: compiled, still compiling or eager (and why), and the forwards
    each path ran (from the devices' Redis readings, inference/worker/compile_reading.py)."""
    try:
        return {"compiled_devices": compile_reading.readings()}
    except Exception:  # Redis down: the table says it cannot read
        return {"compiled_devices": None}


def latest_samples(live: RollupWindow, series: str) -> list[tuple[str, float]]:
    out = []
    for key in live.keys(series):
        row = next((live.rows[(series, key)][s] for s in reversed(live.starts) if s in live.rows[(series, key)]), None)
        if row is not None:
            out.append((key, (row.values or {}).get("max", 0)))
    return out


def archival_progress() -> list[dict]:
    jobs = PartitionArchivalJob.objects.using("default").exclude(step=ArchivalStep.DROPPED).order_by("range_start")[:50]
    out = []
    for job in jobs:
        reached = job.step if job.step in ARCHIVAL_STEPS else job.failed_step  # a failed job: where it was
        done = ARCHIVAL_STEPS.index(reached) if reached in ARCHIVAL_STEPS else 0
        out.append({"job": job, "percent": round(100 * done / (len(ARCHIVAL_STEPS) - 1))})
    return out


def freshness(now: datetime) -> dict:
    latest = OpsRollup.objects.filter(width=RollupWidth.MINUTE, series=PROGRESS_SERIES).values_list(
        "updated_at", flat=True).first()
    return {"rolled_up_at": latest, "stale": latest is None or now - latest > STALE_AFTER}


def dashboard_context(now: datetime | None = None) -> dict:
    now = now or timezone.now()
    live = RollupWindow.load(RollupWidth.MINUTE, LIVE_MINUTES, now)
    day = RollupWindow.load(RollupWidth.HOUR, DAY_HOURS, now)
    day_generation = day.total("generation")
    status_counts = {name: (day_generation.values or {}).get(name, 0) for name in ("succeeded", "failed", "cancelled")}
    hour_generation = live.total("generation")
    return {
        "now": now,
        **freshness(now),
        "live_sessions": Session.objects.filter(status__in=list(LIVE_STATUSES)).count(),
        "sessions_by_status": status_counts,
        "generations_hour": hour_generation.count,
        "tokens_per_s_hour": (hour_generation.values or {}).get("tokens", 0) / (LIVE_MINUTES * 60),
        "slo_p95": conf.SLO_P95_MS, "slo_p99": conf.SLO_P99_MS,
        "slo_ttft_ms": TTFT_SLO_SECONDS * 1000, "slo_itl_ms": ITL_SLO_SECONDS * 1000,
        **throughput_charts(live),
        **latency_charts(live, day),
        **batching_charts(live),
        **acceptance_charts(live, day),
        **cache_and_replica_charts(live),
        **prefix_cache_charts(live),
        **compiled_forwards(),
        "default_rows": latest_samples(live, "default_rows"),
        "archival_jobs": archival_progress(),
        "active_models": ModelVersion.objects.filter(status=VersionStatus.ACTIVE).order_by("name", "role"),
    }
