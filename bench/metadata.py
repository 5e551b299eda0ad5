"""Metadata at scale: keyset vs OFFSET, the recent-activity index, pruning, writers vs rotation.

Creates its own database (``specops_bench``, dropped at the end unless ``--keep``), makes daily
partitions for ``--days`` days through the real rotation, loads token history over them
(``INSERT ... SELECT generate_series``), one long session's candidates and a sessions table, then
prints each figure next to its baseline measured in the same run:

* candidates of one session by ``score DESC, step, branch`` (many ties): keyset page vs OFFSET
  page at depths 0 / 10k / 100k, both through the ORM (``CandidatePagination.page`` vs a slice);
* "sessions active in the last 30 minutes" without and with the adaptive partial index;
* yesterday's tokens (a recent partition, 30k rows) at ~1M and at ``--scale-rows`` rows in the
  table, pruned (EXPLAIN shows one partition) vs the same filter written so that it cannot prune;
* writer throughput (``--writers`` processes, batched idempotent inserts) during a rotation that
  archives five partitions vs before/after it, and the rows lost (loaded + written - in tables -
  in verified archives);
* partitioned sessions (tables of its own shaped like metadata_session, ids UUIDv7 of
  ``created_at`` made in SQL): ``--sessions`` rows over 30 daily partitions and the same rows
  unpartitioned; the state read by id p50/p99 with the partition key derived from the id, without
  it (every partition's index), and on the unpartitioned table; the live-sessions query on both;
  and ``convert_to_partitioned`` on an unpartitioned table of ``--convert-sessions`` rows while
  ``--writers`` processes insert and update, with the rows lost (loaded + inserted - rows after,
  plus updates missing, plus errors the writers saw).

    .venv/bin/python bench/metadata.py [--scale-rows 10000000] [--sessions 10000000] [--keep]

Last line: ``RESULT keyset_depth100k_over_page1=... offset_depth100k_over_page1=...
writer_throughput_during_rotation=... rows_lost=... session_lookup_partitioned_over_unpartitioned=...
session_migration_rows_lost=...``
"""
from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH_DIR.parent), str(BENCH_DIR)]  # the project first: it has a `metadata` package too

import metadata_workload as workload  # noqa: E402
import psycopg  # noqa: E402

PAGE = 50


def say(line: str) -> None:
    print(line, flush=True)


def median_ms(action: Callable[[], object], reps: int = 15, warmup: int = 3) -> float:
    for _ in range(warmup):
        action()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        action()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def recreate_database(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def drop_database(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def count(table: str, where: str = "", params: list | None = None) -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {table} {where}", params)
        return cursor.fetchone()[0]


# ---------------------------------------------------------------------------------------- load
def load(args, now: dt.datetime) -> dict:
    from django.core.management import call_command

    from inference.models import ModelVersion
    from metadata.models import Tenant
    from metadata.partitions.bounds import bin_start
    from metadata.partitions.lifecycle import PartitionPolicy, PartitionRotation
    from metadata.partitions.pacing import Pacer

    call_command("migrate", verbosity=0)
    started = time.perf_counter()
    keep_all = PartitionPolicy(retention=dt.timedelta(days=args.days + 30))
    for back in range(args.days, -1, -1):  # the real rotation, day by day (unpaced: nothing to yield to yet)
        PartitionRotation(keep_all, progress=lambda _: None, pacer=Pacer(0)).run(now - dt.timedelta(days=back))
    partitions_made = time.perf_counter() - started
    today = bin_start(now, dt.timedelta(days=1))
    tokens = 0
    for back in range(args.days, -1, -1):
        tokens += workload.load_tokens(today - dt.timedelta(days=back), args.sessions_per_day, args.tokens_per_session)
        if back % 5 == 0:
            say(f"  loaded {tokens:,} token rows ({time.perf_counter() - started:.0f} s)")
    big_session, big_created = uuid.uuid4(), today + dt.timedelta(minutes=5)
    candidates = workload.load_big_session_candidates(big_session, big_created, args.big_steps, 4)
    tenant = Tenant.objects.create(name="bench")
    target = ModelVersion.objects.create(name="bench", version="1", role="target", path="/nonexistent", context_length=512)
    sessions = workload.load_sessions(tenant.pk, target.pk, args.activity_sessions, args.recent_sessions, now)
    workload.execute("ANALYZE")
    seconds = time.perf_counter() - started - partitions_made
    partitions = count("pg_inherits", "WHERE inhparent = 'metadata_token'::regclass")
    say(f"load: {partitions} partitions per table made by {args.days + 1} rotations in {partitions_made:.1f} s; "
        f"{tokens + candidates + sessions:,} rows ({tokens:,} tokens over {args.days + 1} daily partitions, "
        f"{candidates:,} candidates in one session, {sessions:,} sessions) loaded and analyzed in {seconds:.1f} s")
    return {"session": big_session, "created": big_created, "today": today, "tokens": tokens}


# ------------------------------------------------------------------------------ measurements
def keyset_vs_offset(session_id: uuid.UUID, created: dt.datetime, reps: int = 31) -> dict[str, float]:
    """Median page latency; every variant runs once per round, so a noisy neighbour hits all alike."""
    from metadata.api.pagination import CandidatePagination, encode_cursor
    from metadata.models import Candidate

    queryset = Candidate.objects.filter(session_id=session_id, session_created_at=created)
    ordered = queryset.order_by("-score", "step", "branch")
    pagination = CandidatePagination()
    variants: dict[str, Callable[[], object]] = {}
    for depth in (0, 10_000, 100_000):
        cursor = None
        if depth:
            row = ordered[depth - 1]
            cursor = encode_cursor([row.score, row.step, row.branch])
        keyset_page, _ = pagination.page(queryset, cursor, PAGE)
        assert [(c.step, c.branch) for c in keyset_page] == [(c.step, c.branch) for c in ordered[depth:depth + PAGE]]
        variants[f"keyset_{depth}"] = lambda cursor=cursor: pagination.page(queryset, cursor, PAGE)
        variants[f"offset_{depth}"] = lambda depth=depth: list(ordered[depth:depth + PAGE])
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_number in range(reps + 3):
        for name, action in variants.items():
            start = time.perf_counter()
            action()
            if round_number >= 3:  # warm-up rounds
                samples[name].append((time.perf_counter() - start) * 1000)
    figures = {name: statistics.median(values) for name, values in samples.items()}
    for depth in (0, 10_000, 100_000):
        say(f"candidates page at depth {depth:>7,}: keyset {figures[f'keyset_{depth}']:7.2f} ms   "
            f"OFFSET {figures[f'offset_{depth}']:7.2f} ms")
    return figures


def plan_nodes(sql: str, params: list) -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}", params)
        return " / ".join(line.strip() for (line,) in cursor.fetchall() if "Scan" in line)


def recent_sessions_lookup(now: dt.datetime) -> None:
    from django.db import connection

    from metadata.partitions.recent_index import recent_sessions, rotate_recent_index

    sql, params = recent_sessions(30, now=now).values_list("id").query.sql_with_params()

    def run() -> int:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return len(cursor.fetchall())

    without = median_ms(run)
    plan_without = plan_nodes(sql, list(params))
    rotate_recent_index(now)
    with_index = median_ms(run)
    say(f"sessions active in the last 30 min ({run()} of {count('metadata_session'):,}): "
        f"without index {without:.2f} ms [{plan_without}]; with adaptive index {with_index:.2f} ms "
        f"[{plan_nodes(sql, list(params))}]")


def recent_partition_query(today: dt.datetime, label: str) -> None:
    """Yesterday's tokens: a recent partition whose size the writers and the scale-up leave alone."""
    from django.db import connection

    day = [today - dt.timedelta(days=1), today]
    pruned = "SELECT count(*), avg(logprob) FROM metadata_token WHERE session_created_at >= %s AND session_created_at < %s"
    unpruned = ("SELECT count(*), avg(logprob) FROM metadata_token "
                "WHERE session_created_at + interval '0 s' >= %s AND session_created_at + interval '0 s' < %s")

    def run(sql: str) -> Callable[[], object]:
        def query() -> object:
            with connection.cursor() as cursor:
                cursor.execute(sql, day)
                return cursor.fetchone()
        return query

    scans = plan_nodes(pruned, day)
    total = count("metadata_token")
    say(f"yesterday's tokens with {total:,} rows in the table ({label}): pruned {median_ms(run(pruned), reps=7):.2f} ms, "
        f"{scans.count('Scan on')} partition scanned [{scans}]; "
        f"unprunable filter (baseline) {median_ms(run(unpruned), reps=3, warmup=1):.1f} ms")


def writers_during_rotation(args, url: str, archive_dir: str, today: dt.datetime, now: dt.datetime) -> tuple[float, int]:
    from metadata.models import PartitionArchivalJob
    from metadata.partitions.lifecycle import PartitionPolicy, PartitionRotation

    before = count("metadata_token")
    ctx = mp.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    created = today + dt.timedelta(hours=1)
    procs = [ctx.Process(target=workload.writer_process, args=(url, archive_dir, created, stop, results))
             for _ in range(args.writers)]
    for proc in procs:
        proc.start()
    time.sleep(args.window + 3)  # start-up and warm-up, then the "before" window
    rotation_start = time.time()
    report = PartitionRotation(PartitionPolicy(retention=dt.timedelta(days=args.days - 5)),
                               progress=lambda _: None).run(now)
    rotation_end = time.time()
    time.sleep(args.window)
    stop.set()
    per_writer = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join()
    batches = [b for writer in per_writer for b in writer]
    stall = max(b[0] - a[0] for writer in per_writer for a, b in zip(writer, writer[1:])
                if rotation_start <= b[0] <= rotation_end + 1)
    during = workload.rows_between(batches, rotation_start, rotation_end) / (rotation_end - rotation_start)
    baseline = (workload.rows_between(batches, rotation_start - args.window, rotation_start)
                + workload.rows_between(batches, rotation_end, rotation_end + args.window)) / (2 * args.window)
    written = sum(rows for _, rows in batches)
    archived = sum(PartitionArchivalJob.objects.filter(parent_table="metadata_token", step="dropped")
                   .values_list("row_count", flat=True))
    lost = before + written - count("metadata_token") - archived
    say(f"writers ({args.writers} processes, batches of 100): {baseline:,.0f} rows/s without rotation, "
        f"{during:,.0f} rows/s during a {rotation_end - rotation_start:.1f} s rotation that archived "
        f"{len(report.archived)} partitions ({archived:,} rows) -> {during / baseline:.2f}; longest wait between "
        f"a writer's commits during it {stall * 1000:.0f} ms; failed jobs {len(report.failed)}")
    say(f"rows: {before:,} before + {written:,} written = {count('metadata_token'):,} in tables + "
        f"{archived:,} in verified archives + {lost} lost")
    return during / baseline, lost


def scale_up(args, today: dt.datetime) -> None:
    from metadata.partitions import catalog

    missing = args.scale_rows - count("metadata_token")
    recent = today - dt.timedelta(days=1)  # the partition the recent-day query reads keeps its size
    days = [p.bounds.start for p in catalog.range_partitions("metadata_token") if p.bounds.start < recent]
    per_day = max(missing // (len(days) * args.tokens_per_session), 0)
    started = time.perf_counter()
    for n, start in enumerate(days, 1):
        workload.load_tokens(start, per_day, args.tokens_per_session)
        if n % 10 == 0:
            say(f"  scaled {n}/{len(days)} partitions ({time.perf_counter() - started:.0f} s)")
    workload.execute("ANALYZE metadata_token")
    say(f"scale-up: +{per_day * len(days) * args.tokens_per_session:,} token rows into {len(days)} older "
        f"partitions in {time.perf_counter() - started:.1f} s")


# ---------------------------------------------------------------- partitioned sessions (issue 16)
PART, PLAIN, CONVERTED = "bench_session_part", "bench_session_plain", "bench_session_conv"
STATE_BY_ID = "SELECT id, tenant_id, status, token_count, updated_at FROM {table} WHERE id = %s"  # state.py's read
# The application's reads are not server-side prepared (Django binds on the client; PgBouncer in
# transaction mode needs prepare_threshold=None), so every lookup is planned, as here.
PREPARE = False
LIVE_SESSIONS = ("SELECT id FROM {table} WHERE status IN ('queued', 'running') "
                 "ORDER BY last_activity_at LIMIT 50")


def daily_partitions(table: str, today: dt.datetime, days: int) -> list[tuple[str, dt.datetime, dt.datetime]]:
    from metadata.partitions.bounds import TimeRange, partition_name

    day = dt.timedelta(days=1)
    return [(partition_name(table, TimeRange(start, start + day)), start, start + day)
            for start in (today - day * back for back in range(days - 1, -1, -1))]


def load_session_tables(args, now: dt.datetime, today: dt.datetime) -> None:
    """``--sessions`` sessions over 30 daily partitions, and the same rows in an unpartitioned copy."""
    started = time.perf_counter()
    partitions = daily_partitions(PART, today, 30)
    workload.create_bench_sessions(PART, partitions)
    per_day, live = args.sessions // 30, max(args.sessions // 2000, 30)
    for n, (_, start, end) in enumerate(partitions, 1):
        until = min(end, now)
        workload.load_bench_sessions(PART, start, until, per_day if n < 30 else args.sessions - per_day * 29,
                                     live if n == 30 else 0)
        if n % 10 == 0:
            say(f"  loaded {n}/30 days of sessions ({time.perf_counter() - started:.0f} s)")
    workload.index_bench_sessions(PART)
    workload.create_bench_sessions(PLAIN, None)
    workload.execute(f"INSERT INTO {PLAIN} SELECT * FROM {PART}")
    workload.index_bench_sessions(PLAIN)
    say(f"sessions: {count(PART):,} rows over {len(partitions)} daily partitions (+ DEFAULT) and the same rows in "
        f"an unpartitioned copy, ids UUIDv7 of created_at; loaded, indexed and vacuumed in "
        f"{time.perf_counter() - started:.0f} s")


def timed_lookups(variants: dict[str, Callable[[str], object]], picked: list, warmup: int = 100) -> dict:
    """(p50, p99) ms per variant; interleaved, so a noisy neighbour hits every variant alike."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for n, ident in enumerate(picked):
        for name, lookup in variants.items():
            begin = time.perf_counter()
            row = lookup(ident)
            if n >= warmup:
                samples[name].append((time.perf_counter() - begin) * 1000)
            assert row is not None
    figures = {}
    for name, values in samples.items():
        values.sort()
        figures[name] = (statistics.median(values), values[int(len(values) * 0.99) - 1])
        say(f"session state by id, {name}: p50 {figures[name][0]:.3f} ms, p99 {figures[name][1]:.3f} ms "
            f"({len(values)} lookups)")
    return figures


def session_lookups(args, url: str) -> dict[str, float]:
    """p50/p99 of the state read by id: partitioned with the id's time, without it, unpartitioned."""
    import random

    from metadata.ids import created_at_of

    with psycopg.connect(url, autocommit=True) as conn:
        wait_for_autovacuum(conn)
        ids = [row[0] for row in conn.execute(f"SELECT id FROM {PLAIN} TABLESAMPLE SYSTEM (1) LIMIT 20000")]
        rng = random.Random(7)
        picked = [rng.choice(ids) for _ in range(args.lookups)]
        assert all(created_at_of(i) is not None for i in picked[:10])
        keyed = STATE_BY_ID.format(table=PART) + " AND created_at = %s"

        def by_key(i):
            return conn.execute(keyed, (i, created_at_of(i)), prepare=PREPARE).fetchone()

        def by_id(table: str):
            return lambda i: conn.execute(STATE_BY_ID.format(table=table), (i,), prepare=PREPARE).fetchone()

        figures = timed_lookups({"partitioned, id + created_at from the id": by_key,
                                 "partitioned, id only (every partition)": by_id(PART),
                                 "unpartitioned, id": by_id(PLAIN)}, picked)
        plans = {"keyed": explain(conn, keyed, (picked[0], created_at_of(picked[0]))),
                 "all": explain(conn, STATE_BY_ID.format(table=PART), (picked[0],)),
                 "plain": explain(conn, STATE_BY_ID.format(table=PLAIN), (picked[0],))}
        say(f"  plans: with the key [{plans['keyed']}]; id only [{plans['all'][:150]}...]; "
            f"unpartitioned [{plans['plain']}]")
        live = {}
        for table in (PART, PLAIN):
            sql = LIVE_SESSIONS.format(table=table)
            live[table] = median_ms(lambda sql=sql: conn.execute(sql).fetchall(), reps=31)
            plans[table] = explain(conn, sql, ())
        say(f"live sessions (queued/running by last_activity_at, 50 rows): partitioned {live[PART]:.2f} ms "
            f"[{plans[PART][:140]}...], unpartitioned {live[PLAIN]:.2f} ms [{plans[PLAIN]}]")
    keyed_p50 = figures["partitioned, id + created_at from the id"][0]
    ratio = keyed_p50 / figures["unpartitioned, id"][0]
    say(f"p50 partitioned with the key / unpartitioned: {ratio:.2f} (reads unprepared, as the application's; a "
        f"server-side prepared read favours the unpartitioned table, whose generic plan is cached)")
    return {"ratio": ratio}


def wait_for_autovacuum(conn, limit: float = 240.0) -> None:
    """Let autovacuum finish with the rows just loaded (tokens, sessions) before timing lookups."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit:
        (busy,) = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker' "
                               "AND datname = current_database()").fetchone()
        if not busy:
            break
        time.sleep(2)
    if time.perf_counter() - started > 1:
        say(f"  waited {time.perf_counter() - started:.0f} s for autovacuum before the lookups")


def explain(conn, sql: str, params: tuple) -> str:
    lines = [row[0] for row in conn.execute("EXPLAIN " + sql, params)]
    scans = [line.strip().lstrip("-> ") for line in lines if "Scan" in line or "Subplans Removed" in line]
    return f"{len(scans)} scan(s): " + " / ".join(scans)


def conversion_with_writers(args, url: str, now: dt.datetime, today: dt.datetime) -> int:
    """Convert an unpartitioned sessions table with ``convert_to_partitioned`` while writer processes
    insert and update; rows lost = loaded + inserted - rows after, plus updates missing."""
    from metadata.partitions import PartitionPolicy, convert_to_partitioned

    rows = args.convert_sessions
    workload.create_bench_sessions(CONVERTED, None)
    day = dt.timedelta(days=1)
    for back in range(29, -1, -1):
        start = today - day * back
        workload.load_bench_sessions(CONVERTED, start, min(start + day, now), rows // 30, 0)
    workload.index_bench_sessions(CONVERTED)
    loaded = count(CONVERTED)
    with psycopg.connect(url, autocommit=True) as conn:
        ids = [str(r[0]) for r in conn.execute(f"SELECT id FROM {CONVERTED} TABLESAMPLE SYSTEM (1) LIMIT 5000")]
        (tokens_before,) = conn.execute(f"SELECT sum(token_count) FROM {CONVERTED}").fetchone()
    size_note = "" if rows >= args.sessions else f" (a smaller table than the {args.sessions:,} above: --convert-sessions)"
    say(f"conversion: {loaded:,} sessions in unpartitioned {CONVERTED}{size_note}")
    ctx = mp.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=workload.session_writer_process, args=(url, CONVERTED, ids, stop, results))
             for _ in range(args.writers)]
    for proc in procs:
        proc.start()
    time.sleep(args.window + 2)
    marks: list[tuple[float, str]] = []
    begin = time.time()
    report = convert_to_partitioned(CONVERTED, "created_at", policy=PartitionPolicy(premake=4), batch_rows=5000,
                                    progress=lambda line: marks.append((time.time(), line)), drop_old=True)
    end = time.time()
    time.sleep(2)
    stop.set()
    outcome = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join()
    commits = [c for writer, _ in outcome for c in writer]
    errors = [e for _, writer_errors in outcome for e in writer_errors]
    inserted, updated = sum(c[1] for c in commits), sum(c[2] for c in commits)
    after = count(CONVERTED)
    with psycopg.connect(url, autocommit=True) as conn:
        (tokens_after,) = conn.execute(f"SELECT sum(token_count) FROM {CONVERTED}").fetchone()
        (kind,) = conn.execute("SELECT relkind FROM pg_class WHERE oid = %s::regclass", (CONVERTED,)).fetchone()
    missing, stale = loaded + inserted - after, tokens_before + updated - tokens_after
    copy_start = next(t for t, line in marks if "copying into" in line)
    copy_end = next(t for t, line in marks if "copied" in line and "into" in line and "copying" not in line)
    swap = next(t for t, line in marks if "swapped" in line)
    by_writer = [[c[0] for c in writer] for writer, _ in outcome]
    stall = max((b - a for times in by_writer for a, b in zip(times, times[1:]) if begin <= b <= end + 1), default=0)
    before_rate = sum(c[1] for c in commits if begin - args.window <= c[0] < begin) / args.window
    during_rate = sum(c[1] for c in commits if begin <= c[0] < end) / (end - begin)
    say(f"conversion of {loaded:,} rows with {args.writers} writers running: {report.rows_copied:,} copied in "
        f"{copy_end - copy_start:.1f} s ({report.rows_copied / (copy_end - copy_start):,.0f} rows/s, paced), "
        f"{end - begin:.1f} s in all (prepare, copy, verify {report.rows:,} rows by count + checksum, swap at "
        f"+{swap - begin:.1f} s); table now relkind {kind!r}, {len(report.partitions)} partitions made")
    say(f"  writers: {before_rate:,.0f} inserted rows/s before, {during_rate:,.0f} during; longest wait between a "
        f"writer's commits {stall * 1000:.0f} ms; errors seen by writers: {len(errors)}"
        + (f" (first: {errors[0]})" if errors else ""))
    say(f"  rows: {loaded:,} loaded + {inserted:,} inserted = {after:,} after + {missing} lost; "
        f"{updated:,} updates, {stale} missing from the converted table")
    return missing + abs(stale) + len(errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--admin-url", default="postgres://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--days", type=int, default=35)
    parser.add_argument("--sessions-per-day", type=int, default=300)
    parser.add_argument("--tokens-per-session", type=int, default=100)
    parser.add_argument("--big-steps", type=int, default=50_000, help="steps x 4 branches of one session")
    parser.add_argument("--activity-sessions", type=int, default=200_000,
                        help="metadata_session rows for the recent-activity figure")
    parser.add_argument("--sessions", type=int, default=10_000_000,
                        help="sessions over 30 daily partitions for the lookup figures (0 skips them)")
    parser.add_argument("--convert-sessions", type=int, default=1_000_000,
                        help="rows of the unpartitioned table converted with writers running")
    parser.add_argument("--lookups", type=int, default=3000, help="lookups by id per variant")
    parser.add_argument("--recent-sessions", type=int, default=150)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--window", type=float, default=8.0, help="seconds of writer baseline before/after")
    parser.add_argument("--scale-rows", type=int, default=10_000_000, help="0 skips the large-table figure")
    parser.add_argument("--pause-ratio", type=float, default=None,
                        help="SPECOPS_MAINTENANCE_PAUSE_RATIO for the rotation (default: the setting)")
    parser.add_argument("--sessions-only", action="store_true",
                        help="only the partitioned-sessions figures (the RESULT line then has only their keys)")
    parser.add_argument("--keep", action="store_true", help="keep the bench database")
    args = parser.parse_args()

    url = args.admin_url.rsplit("/", 1)[0] + f"/{workload.BENCH_DB}"
    archive_dir = tempfile.mkdtemp(prefix="specops_bench_archive_")
    recreate_database(args.admin_url, workload.BENCH_DB)
    try:
        workload.setup_django(url, archive_dir)
        from django.conf import settings
        from django.utils import timezone

        if args.pause_ratio is not None:
            settings.SPECOPS_MAINTENANCE_PAUSE_RATIO = args.pause_ratio
        from metadata.partitions.pacing import pause_ratio

        say(f"maintenance pause ratio {pause_ratio()} (busy at most {1 / (1 + pause_ratio()):.0%} of the rotation)")
        now = timezone.now()
        if args.sessions_only:
            from django.core.management import call_command

            from metadata.partitions.bounds import bin_start

            call_command("migrate", verbosity=0)
            today = bin_start(now, dt.timedelta(days=1))
        else:
            loaded = load(args, now)
            today = loaded["today"]
            figures = keyset_vs_offset(loaded["session"], loaded["created"])
            recent_sessions_lookup(now)
            recent_partition_query(today, "after the load")
            throughput, lost = writers_during_rotation(args, url, archive_dir, today, now)
            if args.scale_rows:
                scale_up(args, today)
                recent_partition_query(today, "scaled up")
        session_figures = {"ratio": float("nan")}
        if args.sessions:
            load_session_tables(args, now, today)
            session_figures = session_lookups(args, url)
        session_lost = conversion_with_writers(args, url, now, today)
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep:
            drop_database(args.admin_url, workload.BENCH_DB)
    sessions = (f"session_lookup_partitioned_over_unpartitioned={session_figures['ratio']:.2f} "
                f"session_migration_rows_lost={session_lost}")
    if args.sessions_only:
        say(f"RESULT {sessions}")
        return
    keyset = figures["keyset_100000"] / figures["keyset_0"]
    offset = figures["offset_100000"] / figures["offset_0"]
    say(f"RESULT keyset_depth100k_over_page1={keyset:.2f} offset_depth100k_over_page1={offset:.1f} "
        f"writer_throughput_during_rotation={throughput:.2f} rows_lost={lost} {sessions}")


if __name__ == "__main__":
    main()
