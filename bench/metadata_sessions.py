"""The partitioned-sessions figures of bench/metadata.py (issue 16): lookups by id, live sessions,
and the conversion of an unpartitioned table with writers running.

Tables of its own shaped like metadata_session (ids UUIDv7 of ``created_at`` made in SQL):
``--sessions`` rows over 30 daily partitions and the same rows unpartitioned; the state read by id
p50/p99 with the partition key derived from the id, without it (every partition's index), and on
the unpartitioned table; the live-sessions query on both; and ``convert_to_partitioned`` on an
unpartitioned table of ``--convert-sessions`` rows while ``--writers`` processes insert and update.
"""
from __future__ import annotations

import datetime as dt
import statistics
import time
from collections.abc import Callable

import psycopg

from bench import metadata_workload as workload
from bench.common import median_ms, say
from bench.metadata_workload import count

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
    writers = workload.WriterProcesses(workload.session_writer_process, (url, CONVERTED, ids), args.writers)
    time.sleep(args.window + 2)
    marks: list[tuple[float, str]] = []
    begin = time.time()
    report = convert_to_partitioned(CONVERTED, "created_at", policy=PartitionPolicy(premake=4), batch_rows=5000,
                                    progress=lambda line: marks.append((time.time(), line)), drop_old=True)
    end = time.time()
    time.sleep(2)
    outcome = writers.finish()
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
