"""The capacity plan: what the observed peak, times a buffer (2-3x), needs.

Inputs are measurements (``metadata.insights.load``): statement rates, busy time and block I/O
per database from the pg_stat_statements snapshots; tokens/s and sessions/s from the metadata
tables; storage growth from the partitions' sizes in pg_catalog. What they need:

- pool: connections busy at once at the peak (execution time per second), times the buffer;
  a transaction pooler (PgBouncer) needs that many server connections, and each process's pool
  must not be the bottleneck;
- replicas: SELECT execution time per second at the peak, times the buffer, over the cores of one
  database server (``SPECOPS_CAPACITY_DB_CORES``); the primary keeps the writes;
- worker devices: tokens/s at the peak, times the buffer, over one device's measured tokens/s
  (``SPECOPS_CAPACITY_DEVICE_TOKENS_PER_S``, from ``bench/engine.py``);
- IOPS: shared blocks read or written per second at the peak, times the buffer (blocks read may
  come from the OS cache: an upper bound);
- storage: free space over bytes per day, with and without the buffer on growth; with archival
  the tables level off near bytes per day x retention.
"""
from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from django.conf import settings

from metadata.conf import conf
from metadata.insights.load import (
    DatabaseLoad,
    Rate,
    Storage,
    database_loads,
    max_connections,
    pool_max_size,
    storage,
    tokens_and_sessions,
)
from metadata.insights.window import Window

MIN_BUFFER, DEFAULT_BUCKET_S = 1.0, 60


@dataclass(frozen=True)
class PoolNeed:
    database: str
    busy_peak: float
    connections: int  # server connections busy at once at the peak, with the buffer
    pool_max_size: int | None  # what each process's pool allows now
    max_connections: int | None  # what the server allows


@dataclass(frozen=True)
class Needs:
    pools: list[PoolNeed]
    replicas: int  # for the reads at the peak, with the buffer
    read_cores: float
    primary_cores: float  # the primary's non-SELECT execution at the peak, with the buffer
    worker_devices: int
    iops: float
    days_until_full: float | None
    days_until_full_buffered: float | None
    retained_bytes: float  # bytes per day x retention: where archival keeps the tables
    retained_bytes_buffered: float


@dataclass(frozen=True)
class CapacityPlan:
    window: Window
    buffer: float
    bucket_s: int
    databases: list[DatabaseLoad]
    tokens: Rate
    sessions: Rate
    token_series: list
    storage: Storage
    device_tokens_per_s: float
    db_cores: int
    retention_days: float
    needs: Needs

    def lines(self) -> list[str]:
        return render_lines(self)


def _fmt_bytes(value: float | None) -> str:
    if value is None:
        return "unknown"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1024 or unit == "TB":
            return f"{value:.3g} {unit}" if unit != "B" else f"{value:.0f} B"
        value /= 1024
    return f"{value:.3g} TB"


def _days(value: float | None) -> str:
    return "never at this growth" if value is None else f"{value:,.0f} days" if value >= 10 else f"{value:.1f} days"


def _needs(databases: list[DatabaseLoad], tokens: Rate, store: Storage, buffer: float, cores: int,
           device_tps: float, retention_days: float) -> Needs:
    pools = [PoolNeed(d.database, d.busy.peak, max(1, math.ceil(d.busy.peak * buffer)), pool_max_size(d.database),
                      max_connections(d.database)) for d in databases]
    read_cores = sum(d.read_busy.peak for d in databases) * buffer
    primary = next((d for d in databases if d.database == "default"), None)
    primary_cores = max(primary.busy.peak - primary.read_busy.peak, 0.0) * buffer if primary else 0.0
    per_day = store.bytes_per_day
    free = store.free_bytes
    return Needs(
        pools=pools,
        replicas=math.ceil(read_cores / cores) if read_cores > 0 else 0,
        read_cores=read_cores,
        primary_cores=primary_cores,
        worker_devices=math.ceil(tokens.peak * buffer / device_tps) if tokens.peak > 0 else 0,
        iops=sum(d.iops.peak for d in databases) * buffer,
        days_until_full=free / per_day if free is not None and per_day > 0 else None,
        days_until_full_buffered=free / (per_day * buffer) if free is not None and per_day > 0 else None,
        retained_bytes=per_day * retention_days,
        retained_bytes_buffered=per_day * buffer * retention_days,
    )


def capacity_plan(hours: float = 24.0, buffer: float | None = None, bucket_s: int = DEFAULT_BUCKET_S,
                  now: dt.datetime | None = None) -> CapacityPlan:
    """The plan for the last ``hours``, with ``buffer`` (default ``SPECOPS_CAPACITY_BUFFER``) over the peak."""
    buffer = float(conf.CAPACITY_BUFFER if buffer is None else buffer)
    if not buffer >= MIN_BUFFER:
        raise ValueError(f"buffer must be at least {MIN_BUFFER:g} (a multiple of the peak), got {buffer:g}")
    if not bucket_s >= 1:
        raise ValueError(f"bucket must be at least 1 second, got {bucket_s}")
    window = Window.last(hours, now)
    databases = database_loads(window)
    traffic = tokens_and_sessions(window, bucket_s)
    (tokens, token_series), (sessions, _) = traffic["tokens"], traffic["sessions"]
    store = storage(window.end)
    cores, device_tps = int(conf.CAPACITY_DB_CORES), float(conf.CAPACITY_DEVICE_TOKENS_PER_S)
    retention = float(conf.PARTITION_RETENTION_DAYS)
    return CapacityPlan(window, buffer, bucket_s, databases, tokens, sessions, token_series, store, device_tps,
                        cores, retention, _needs(databases, tokens, store, buffer, cores, device_tps, retention))


def _at(rate: Rate) -> str:
    return f" at {rate.peak_at:%Y-%m-%d %H:%M} UTC" if rate.peak_at else ""


def render_lines(plan: CapacityPlan) -> list[str]:
    b = plan.buffer
    out = [f"Capacity plan for {plan.window.label()}, buffer {b:g}x over the observed peak",
           "Statements (pg_stat_statements snapshots):"]
    if not plan.databases:
        out.append("  no snapshots in the window: is beat running metadata.insights.snapshot_statements?")
    for d in plan.databases:
        out.append(f"  {d.database}: {d.snapshots} snapshots over {d.covered_s / 3600:.2f} h; statements/s "
                   f"{d.statements.average:.1f} average, {d.statements.peak:.1f} peak{_at(d.statements)}")
        out.append(f"    busy connections {d.busy.average:.2f} average, {d.busy.peak:.2f} peak (SELECT "
                   f"{d.read_busy.peak:.2f}); IOPS {d.iops.average:.0f} average, {d.iops.peak:.0f} peak")
        for family, rate in d.families[:6]:
            out.append(f"    {family}: {rate.average:.2f}/s average, {rate.peak:.2f}/s peak")
        if len(d.families) > 6:
            out.append(f"    ... {len(d.families) - 6} more families")
    out += ["Traffic (metadata tables, "
            f"{plan.bucket_s} s buckets):",
            f"  tokens/s {plan.tokens.average:.2f} average, {plan.tokens.peak:.2f} peak{_at(plan.tokens)}",
            f"  sessions/s {plan.sessions.average:.3f} average, {plan.sessions.peak:.3f} peak{_at(plan.sessions)}",
            "Storage (partition sizes from pg_catalog):"]
    for t in plan.storage.tables:
        out.append(f"  {t.table}: {_fmt_bytes(t.total_bytes)} in {t.partitions} partitions, "
                   f"{_fmt_bytes(t.bytes_per_day)}/day")
    out.append(f"  all: {_fmt_bytes(plan.storage.total_bytes)}, {_fmt_bytes(plan.storage.bytes_per_day)}/day; "
               f"free {_fmt_bytes(plan.storage.free_bytes)} ({plan.storage.free_source})")
    n = plan.needs
    out.append(f"Needs at {b:g}x the peak:")
    for p in n.pools:
        now = f"pool max_size {p.pool_max_size} per process" if p.pool_max_size else "not pooled"
        out.append(f"  {p.database}: {p.connections} server connection{'s' if p.connections != 1 else ''} busy at "
                   f"once ({p.busy_peak:.2f} at the peak; now {now}, max_connections {p.max_connections})")
    out.append(f"  replicas: {n.replicas} for reads ({n.read_cores:.2f} cores of SELECTs over {plan.db_cores} per "
               f"server; configured now: {len(settings.DATABASE_REPLICAS)})")
    out.append(f"  primary: {n.primary_cores:.2f} of {plan.db_cores} cores for everything but SELECTs")
    out.append(f"  worker devices: {n.worker_devices} ({plan.tokens.peak:.1f} tokens/s x {b:g} over "
               f"{plan.device_tokens_per_s:g} tokens/s per device)")
    out.append(f"  IOPS: {n.iops:.0f} (shared blocks read or written at the peak x {b:g}; an upper bound)")
    out.append(f"  storage: full in {_days(n.days_until_full)} at the current growth, "
               f"{_days(n.days_until_full_buffered)} at {b:g}x; archival after {plan.retention_days:g} days keeps "
               f"~{_fmt_bytes(n.retained_bytes)} ({_fmt_bytes(n.retained_bytes_buffered)} at {b:g}x)")
    return out
