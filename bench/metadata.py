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
* partitioned sessions (bench/metadata_sessions.py; tables of its own shaped like
  metadata_session, ids UUIDv7 of ``created_at`` made in SQL): ``--sessions`` rows over 30 daily
  partitions and the same rows unpartitioned; the state read by id p50/p99 with the partition key
  derived from the id, without it (every partition's index), and on the unpartitioned table; the
  live-sessions query on both; and ``convert_to_partitioned`` on an unpartitioned table of
  ``--convert-sessions`` rows while ``--writers`` processes insert and update, with the rows lost
  (loaded + inserted - rows after, plus updates missing, plus errors the writers saw).

    .venv/bin/python bench/metadata.py [--scale-rows 10000000] [--sessions 10000000] [--keep]

Last line: ``RESULT keyset_depth100k_over_page1=... offset_depth100k_over_page1=...
writer_throughput_during_rotation=... rows_lost=... session_lookup_partitioned_over_unpartitioned=...
session_migration_rows_lost=...``
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

# The project first: run as a script, bench/ is on the path too, and this file would be `metadata`.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import metadata_workload as workload  # noqa: E402
from bench.common import ADMIN_URL, database_url, drop_database, median_ms, recreate_database, say  # noqa: E402
from bench.metadata_sessions import conversion_with_writers, load_session_tables, session_lookups  # noqa: E402
from bench.metadata_workload import count  # noqa: E402

PAGE = 50


# ---------------------------------------------------------------------------------------- load
def load(args, now: dt.datetime) -> dict:
    from django.core.management import call_command

    from metadata.models import ModelVersion
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
    created = today + dt.timedelta(hours=1)
    writers = workload.WriterProcesses(workload.writer_process, (url, archive_dir, created), args.writers)
    time.sleep(args.window + 3)  # start-up and warm-up, then the "before" window
    rotation_start = time.time()
    report = PartitionRotation(PartitionPolicy(retention=dt.timedelta(days=args.days - 5)),
                               progress=lambda _: None).run(now)
    rotation_end = time.time()
    time.sleep(args.window)
    per_writer = writers.finish()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--admin-url", default=ADMIN_URL)
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

    url = database_url(args.admin_url, workload.BENCH_DB)
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
