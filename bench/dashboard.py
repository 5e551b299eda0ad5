"""The operators' dashboard at scale: render time from the rollups vs the raw-scan queries it replaced.

Creates its own database (``specops_bench_dashboard``, dropped at the end unless ``--keep``),
loads ``--requests`` request-log rows (10 M) and ``--sessions`` finished sessions (1 M) spread
over the last 24 hours with ``INSERT ... SELECT generate_series`` (server-side, no client round
trip per row; ids ascend with the row number, so the primary keys are appended to rather than
split at random, which halves the load on two cores and changes nothing that is measured), builds the rollups from them the way a backfill would (``backfill_api`` over the
raw log, the rollup job's session aggregation hour by hour, the hours re-merged), then measures:

* ``dashboard_ms``: the whole admin page (``GET /admin/dashboard/`` through Django's test client
  as a superuser: every query, the charts and the template), median of ``--reps`` renders;
* ``raw_scan_ms``: the queries the old dashboard ran on every load (``percentile_cont`` p50/p95/p99
  per hour over 24 h of raw request log, the sessions-by-status count and the per-drafter
  averages of a day of sessions' JSON stats), median of 3.

    .venv/bin/python bench/dashboard.py [--requests 10000000] [--sessions 1000000] [--keep]

Last line: ``RESULT dashboard_ms=<x> raw_scan_ms=<x>`` (done when dashboard_ms <= 200).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import database_url, drop_database, median_ms, recreate_database, say  # noqa: E402

BENCH_DB = "specops_bench_dashboard"
CHUNK = 1_000_000

RAW_SCAN_QUERIES = [
    # the old ops.dashboard.hourly_latency_percentiles
    """SELECT date_trunc('hour', requested_at) AS hour,
              percentile_cont(0.5) WITHIN GROUP (ORDER BY duration_ms),
              percentile_cont(0.95) WITHIN GROUP (ORDER BY duration_ms),
              percentile_cont(0.99) WITHIN GROUP (ORDER BY duration_ms), count(*)
       FROM metadata_request_log WHERE requested_at >= %(since)s GROUP BY 1 ORDER BY 1""",
    # the old sessions_by_status
    """SELECT status, count(id) FROM metadata_session WHERE created_at >= %(since)s GROUP BY status""",
    # the old acceptance_by_drafter
    """SELECT drafter, avg((stats->>'acceptance_rate')::float), avg((stats->>'mean_accepted_length')::float),
              count(*)
       FROM metadata_session
       WHERE status = 'succeeded' AND created_at >= %(since)s AND stats ? 'acceptance_rate'
       GROUP BY drafter ORDER BY drafter""",
]

REQUESTS_SQL = """
    INSERT INTO metadata_request_log (id, requested_at, method, path, status_code, duration_ms, session_id, tenant_id)
    SELECT ('00000000-0000-4000-8000-' || lpad(to_hex(i), 12, '0'))::uuid, %(start)s::timestamptz + (i * %(span)s / %(n)s) * interval '1 second',
           CASE WHEN i %% 5 = 0 THEN 'POST' ELSE 'GET' END, '/api/v1/sessions/',
           CASE WHEN i %% 197 = 0 THEN 500 WHEN i %% 53 = 0 THEN 404 ELSE 200 END,
           exp(random() * 6.5), NULL, %(tenant)s
    FROM generate_series(%(first)s, %(last)s) AS i"""

# Session columns the bench sets; any other column gets its model default (the table may grow).
SESSION_COLUMNS = {
    "id": "('00000000-0000-4000-9000-' || lpad(to_hex(i), 12, '0'))::uuid", "tenant_id": "%(tenant)s", "created_at": "t", "updated_at": "t + interval '3 s'",
    "last_activity_at": "t + interval '3 s'",
    "status": "CASE WHEN i %% 50 = 0 THEN 'failed' WHEN i %% 97 = 0 THEN 'cancelled' ELSE 'succeeded' END",
    "target_id": "%(target)s", "drafter": "d", "queue": "'cpu'", "prompt": "'bench prompt'", "prompt_tokens": "8",
    "params": "'{\"max_new_tokens\": 64}'::jsonb", "token_count": "64", "finish_reason": "'length'",
    "stats": """jsonb_build_object('drafter', d, 'steps', 20, 'drafted', 80, 'accepted', a,
                 'drafted_per_position', jsonb_build_array(20, 20, 20, 20),
                 'accepted_per_position', jsonb_build_array(16, 12, 8, a - 36),
                 'acceptance_rate', a / 80.0, 'mean_accepted_length', (20 + a) / 20.0,
                 'draft_seconds', 0.1, 'verify_seconds', 0.3, 'total_seconds', 0.5,
                 'batch_rows_max', 1 + i %% 8, 'ttft_seconds', 0.05 + random() * 0.6,
                 'itl_seconds', 0.01 + random() * 0.08)""",
    "started_at": "t + interval '200 ms'", "finished_at": "t + interval '3 s'",
}
SESSIONS_FROM = """
    FROM generate_series(%(first)s, %(last)s) AS i,
         LATERAL (SELECT %(start)s::timestamptz + (i * %(span)s / %(n)s) * interval '1 second' AS t,
                         (ARRAY['tree', 'draft_model', 'ngram'])[1 + i %% 3] AS d, 40 + i %% 8 AS a) AS x"""


def sessions_sql() -> tuple[str, dict]:
    """The INSERT ... SELECT of sessions over the model's columns, and the defaults it passes."""
    from django.db import connection

    from metadata.models import Session

    columns, expressions, defaults = [], [], {}
    for field in Session._meta.concrete_fields:
        columns.append(f'"{field.column}"')
        if field.column in SESSION_COLUMNS:
            expressions.append(SESSION_COLUMNS[field.column])
        else:
            defaults[f"default_{field.column}"] = field.get_db_prep_save(field.get_default(), connection)
            expressions.append(f"%(default_{field.column})s")
    sql = f"INSERT INTO metadata_session ({', '.join(columns)}) SELECT {', '.join(expressions)} {SESSIONS_FROM}"
    return sql, defaults


def execute(sql: str, params: dict | list | None = None) -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def ensure_daily_partitions(start: dt.datetime, end: dt.datetime) -> None:
    """Give every UTC day of [start, end) a request-log partition (migrate makes today's and ahead)."""
    from django.db import DatabaseError, transaction

    day = start.replace(hour=0, minute=0, second=0, microsecond=0)
    while day < end:
        name = f"metadata_request_log_bench_{day:%Y%m%d}"
        try:
            with transaction.atomic():
                execute(f'CREATE TABLE "{name}" PARTITION OF metadata_request_log FOR VALUES FROM (%s) TO (%s)',
                        [day, day + dt.timedelta(days=1)])
        except DatabaseError:
            pass  # a partition already covers that day
        day += dt.timedelta(days=1)


def load(args, now: dt.datetime) -> dict:
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from metadata.models import ModelVersion
    from metadata.models import Tenant

    call_command("migrate", verbosity=0)
    start = now - dt.timedelta(hours=24)
    ensure_daily_partitions(start, now + dt.timedelta(minutes=1))
    tenant = Tenant.objects.create(name="bench")
    target = ModelVersion.objects.create(name="bench", version="1", role="target", path="/nonexistent",
                                         context_length=512, status="active")
    get_user_model().objects.create_superuser("bench-admin", password="bench-admin-pw")
    started = time.perf_counter()
    span = (now - start).total_seconds() - 60  # the last minute stays empty: rows are in closed minutes
    for first in range(0, args.requests, CHUNK):
        last = min(first + CHUNK, args.requests) - 1
        execute(REQUESTS_SQL, {"start": start, "span": span, "n": args.requests, "first": first, "last": last,
                               "tenant": tenant.pk})
        say(f"  request log: {last + 1:,} rows ({time.perf_counter() - started:.0f} s)")
    insert_sessions, defaults = sessions_sql()
    for first in range(0, args.sessions, CHUNK // 4):
        last = min(first + CHUNK // 4, args.sessions) - 1
        execute(insert_sessions, {"start": start, "span": span, "n": args.sessions, "first": first, "last": last,
                                  "tenant": tenant.pk, "target": target.pk, **defaults})
        say(f"  sessions: {last + 1:,} rows ({time.perf_counter() - started:.0f} s)")
    execute("ANALYZE")
    say(f"load: {args.requests:,} request-log rows and {args.sessions:,} sessions over 24 h in "
        f"{time.perf_counter() - started:.0f} s")
    return {"start": start}


def build_rollups(start: dt.datetime, now: dt.datetime) -> None:
    from ops.rollups import aggregate_span, backfill_api, floor_hour, floor_minute, roll_hours, roll_up

    started = time.perf_counter()
    first, end = floor_minute(start), floor_minute(now)
    api_rows = backfill_api(first, end)
    say(f"rollups: api {api_rows:,} minute rows from the raw log in one scan ({time.perf_counter() - started:.0f} s)")
    sessions = 0
    hour = floor_hour(first)
    while hour < end:
        done, _ = aggregate_span(max(hour, first), min(hour + dt.timedelta(hours=1), end), read_streams=False)
        sessions += done
        hour += dt.timedelta(hours=1)
    roll_hours(first, end)
    roll_up(now)  # one live run: the current minutes and one sample of each sampled series
    from ops.models import OpsRollup

    say(f"rollups: {sessions:,} sessions aggregated, {OpsRollup.objects.count():,} rollup rows in all "
        f"({time.perf_counter() - started:.0f} s)")


def measure(args, since: dt.datetime) -> tuple[float, float]:
    from django.db import connection
    from django.test import Client

    client = Client()
    client.login(username="bench-admin", password="bench-admin-pw")

    def render() -> None:
        response = client.get("/admin/dashboard/")
        assert response.status_code == 200, response.status_code
        assert b'class="chart"' in response.content

    def raw_scan() -> None:
        with connection.cursor() as cursor:
            for sql in RAW_SCAN_QUERIES:
                cursor.execute(sql, {"since": since})
                cursor.fetchall()

    html = client.get("/admin/dashboard/").content.decode()
    charts, points = html.count('class="chart"'), html.count('class="point"')
    say(f"dashboard: {charts} charts, {points} data points")
    dashboard_ms = median_ms(render, args.reps, warmup=2)
    cpu = []
    for _ in range(args.reps):
        started = time.process_time()
        render()
        cpu.append((time.process_time() - started) * 1000)
    say(f"dashboard from rollups: median {dashboard_ms:.1f} ms over {args.reps} renders "
        f"({statistics.median(cpu):.1f} ms of it this process's CPU; load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} cores)")
    raw_ms = median_ms(raw_scan, 3, warmup=0)
    say(f"raw scan (old dashboard queries over 24 h of raw rows): median {raw_ms:.0f} ms over 3 runs")
    return dashboard_ms, raw_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000_000)
    parser.add_argument("--sessions", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--keep", action="store_true", help="keep the bench database")
    args = parser.parse_args()
    base = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/specops")
    admin_url, url = database_url(base, "postgres"), database_url(base, BENCH_DB)
    recreate_database(admin_url, BENCH_DB)
    os.environ.update(DATABASE_URL=url, DATABASE_REPLICA_URLS="", LOG_LEVEL="WARNING")
    os.environ.setdefault("SECRET_KEY", "bench-only-secret-key-not-for-production-0123456789")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "specops.settings")
    import django

    django.setup()
    from django.utils import timezone

    try:
        now = timezone.now()
        loaded = load(args, now)
        build_rollups(loaded["start"], now)
        dashboard_ms, raw_ms = measure(args, loaded["start"])
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep:
            drop_database(admin_url, BENCH_DB)
    say(f"RESULT dashboard_ms={dashboard_ms:.1f} raw_scan_ms={raw_ms:.0f}")


if __name__ == "__main__":
    main()
