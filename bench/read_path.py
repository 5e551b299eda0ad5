"""Read path under a speculative burst: cache off vs Redis only vs two-tier, in one run.

Every verification step of a speculative generation, each of its branches reads the session's
state. Redis starts as production leaves it (each session's state written through at its last
update; ``two_tier_cold`` empties it first); in-process tiers start empty. The burst: ``--branches`` (64) branches x ``--sessions`` (200) sessions x ``--steps`` steps,
spread over ``--processes`` processes x ``--threads`` threads, all branches of one session at about
the same time. A writer process updates random sessions meanwhile (``--writes-per-s``), like the
workers do, so invalidation and write-through are part of the picture.

Then two checks: own writes read back while the replica's replay is paused (stale own reads,
in-process and across processes through the floor a client would carry in X-SpecOps-LSN), and
Redis stopped in the middle of a burst (a redis-server of our own on a spare port; errors,
reads served from the database, cache back in use after the restart).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/specops_read \\
    DATABASE_REPLICA_URLS=postgres://postgres@127.0.0.1:5433/specops_read \\
    REDIS_URL=redis://127.0.0.1:6379/5 .venv/bin/python bench/read_path.py

The database must be migrated (``manage.py migrate``). Last line:
``RESULT db_queries_per_1000=... p99_ms_two_tier=... stale_own_reads=... errors_redis_down=...``
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH_DIR.parent), str(BENCH_DIR)]  # the project, and read_path_workers
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "specops.settings")

from read_path_workers import (  # noqa: E402  (needs the path above)
    MODES,
    BurstReport,
    PrivateRedis,
    burst_worker,
    own_writes_worker,
    redis_down_worker,
    setup_django,
    writer_process,
)
from bench.common import percentile  # noqa: E402


def prepare_sessions(count: int) -> list[str]:
    from metadata.models import ModelVersion
    from metadata.models import Session, Tenant

    tenant, _ = Tenant.objects.get_or_create(name="bench-read-path")
    target, _ = ModelVersion.objects.get_or_create(
        name="bench-read-path", version="1", role="target", defaults={"path": "/nonexistent", "context_length": 512}
    )
    Session.objects.filter(tenant=tenant).delete()
    sessions = Session.objects.bulk_create(
        Session(tenant=tenant, target=target, drafter="tree", queue="cpu", prompt="bench", prompt_tokens=1)
        for _ in range(count)
    )
    return [str(s.pk) for s in sessions]


def drop_sessions() -> None:
    from metadata.models import Session

    Session.objects.filter(tenant__name="bench-read-path").delete()


def replica_admin(sql: str) -> str | None:
    """Run ``sql`` on the first replica's server (pause/resume replay, positions)."""
    import psycopg
    from django.conf import settings

    config = settings.DATABASES[settings.DATABASE_REPLICAS[0]]
    with psycopg.connect(host=config["HOST"], port=config["PORT"], user=config["USER"] or "postgres",
                         dbname="postgres", autocommit=True, connect_timeout=3) as conn:
        row = conn.execute(sql).fetchone()
        return None if row is None or row[0] is None else str(row[0])


def wait_for_replica() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_wal_insert_lsn()::text")
        target = cursor.fetchone()[0]
    deadline = time.monotonic() + 30
    while replica_admin(f"SELECT pg_last_wal_replay_lsn() >= '{target}'::pg_lsn") != "True":
        if time.monotonic() > deadline:
            raise SystemExit("the replica did not catch up in 30 s; is scripts/services.sh up?")
        time.sleep(0.05)


def clear_cache_keys(ids: list[str]) -> None:
    from metadata.cache import default_guard

    keys = [f"specops:c:session_state:{i}{suffix}" for i in ids for suffix in ("", ":inv", ":lock")]
    default_guard().run(lambda client: client.delete(*keys))


def warm_by_write_through(ids: list[str]) -> None:
    """Leave Redis as production does: each session's state written through at its last update
    (in-process tiers start empty in the spawned readers)."""
    from metadata.cache import default_guard
    from sessions.state import STATE, invalidate_session

    for sid in ids:
        invalidate_session(sid, regions=[STATE])
    keys = [f"specops:c:session_state:{sid}" for sid in ids]
    present = default_guard().run(lambda client: client.exists(*keys))
    if present != len(ids):  # otherwise the warm modes would measure a cold start (issue 28)
        raise SystemExit(f"after the write-through warm-up {present} of {len(ids)} sessions' states are in Redis")


def run_processes(target, args_for, count: int, timeout_s: float = 600) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(count)
    processes = [ctx.Process(target=target, args=(*args_for(i), barrier, results)) for i in range(count)]
    for process in processes:
        process.start()
    reports = [results.get(timeout=timeout_s) for _ in processes]
    for process in processes:
        process.join(30)
    failed = [r for r in reports if isinstance(r, str)]
    if failed:
        raise SystemExit("a benchmark process failed:\n" + "\n".join(failed))
    return reports


def run_burst(mode: str, ids: list[str], args) -> dict:
    clear_cache_keys(ids)
    if mode in ("redis", "two_tier"):
        warm_by_write_through(ids)
    ctx = mp.get_context("spawn")
    stop_writer, writer_results = ctx.Event(), ctx.Queue()
    writer = ctx.Process(target=writer_process, args=(ids, args.writes_per_s, stop_writer, writer_results))
    writer.start()
    started = time.perf_counter()
    reports: list[BurstReport] = run_processes(
        burst_worker,
        lambda i: (mode, i, args.processes, args.threads, args.steps, args.branches, ids),
        args.processes,
    )
    elapsed = time.perf_counter() - started
    stop_writer.set()
    refreshes = writer_results.get(timeout=60)  # write-through reads: cache work, counted for the caches
    refreshes = 0 if mode == "off" else refreshes
    writer.join(30)
    latencies = sorted(v for r in reports for v in r.latencies_us)
    reads = sum(r.reads for r in reports)
    queries = {alias: sum(r.queries.get(alias, 0) for r in reports) for alias in {a for r in reports for a in r.queries}}
    db_queries = sum(queries.values()) + sum(r.probe_queries for r in reports) + refreshes
    db_reads = sum(queries.values())
    return {
        "mode": mode, "reads": reads, "errors": sum(r.errors for r in reports), "seconds": elapsed,
        "db_queries_per_1000": 1000 * db_queries / reads,
        "p50_ms": percentile(latencies, 0.50) / 1000, "p99_ms": percentile(latencies, 0.99) / 1000,
        "p99_ms_local_hits": percentile(sorted(v for r in reports for v in r.local_hit_latencies_us), 0.99) / 1000,
        "replica_share_of_db_reads": sum(v for a, v in queries.items() if a != "default") / db_reads if db_reads else 0,
        "served_local": sum(r.local for r in reports) / reads, "served_redis": sum(r.redis for r in reports) / reads,
        "served_db": sum(r.loads for r in reports) / reads, "queries": queries,
        "probe_queries": sum(r.probe_queries for r in reports), "write_through_reads": refreshes,
    }


def run_own_writes(ids: list[str], args) -> tuple[int, int]:
    """Replica replay paused: write, then read back in the same process and in the next one."""
    clear_cache_keys(ids)
    ctx = mp.get_context("spawn")
    inboxes = [ctx.Queue() for _ in range(args.processes)]
    results, barrier = ctx.Queue(), ctx.Barrier(args.processes)
    processes = [
        ctx.Process(target=own_writes_worker, args=(i, args.processes, ids, args.own_writes, inboxes[i],
                                                    inboxes[(i + 1) % args.processes], barrier, results))
        for i in range(args.processes)
    ]
    replica_admin("SELECT pg_wal_replay_pause()")
    try:
        for process in processes:
            process.start()
        reports = [results.get(timeout=300) for _ in processes]
        for process in processes:
            process.join(30)
    finally:
        replica_admin("SELECT pg_wal_replay_resume()")
    failed = [r for r in reports if isinstance(r, str)]
    if failed:
        raise SystemExit("a benchmark process failed:\n" + "\n".join(failed))
    return sum(r[0] for r in reports), sum(r[1] for r in reports)


def run_redis_down(ids: list[str], args) -> dict:
    server = PrivateRedis()
    server.start()
    saved_url = os.environ.get("REDIS_URL")
    os.environ["REDIS_URL"] = server.url  # the spawned workers read it when they set Django up
    ctx = mp.get_context("spawn")
    down, up, stop = ctx.Event(), ctx.Event(), ctx.Event()
    results, barrier = ctx.Queue(), ctx.Barrier(args.processes + 1)
    processes = [ctx.Process(target=redis_down_worker, args=(i, args.processes, args.threads, ids, down, up, stop,
                                                             barrier, results)) for i in range(args.processes)]
    try:
        for process in processes:
            process.start()
        barrier.wait(timeout=120)
        time.sleep(1.0)
        server.stop()
        down.set()
        time.sleep(1.5)
        server.start()
        up.set()
        time.sleep(2.0)
        stop.set()
        reports = [results.get(timeout=120) for _ in processes]
    finally:
        stop.set()
        for process in processes:
            process.join(30)
        server.remove()
        if saved_url is None:
            os.environ.pop("REDIS_URL", None)
        else:
            os.environ["REDIS_URL"] = saved_url
    failed = [r for r in reports if isinstance(r, str)]
    if failed:
        raise SystemExit("a benchmark process failed:\n" + "\n".join(failed))
    return {key: sum(r[key] for r in reports) for key in reports[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--branches", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="verification steps: reads per branch and session")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--writes-per-s", type=float, default=20.0, help="session updates by the writer")
    parser.add_argument("--own-writes", type=int, default=150, help="write-then-read cycles per thread")
    parser.add_argument("--modes", default=",".join(MODES), help="burst modes to run (RESULT needs two_tier)")
    parser.add_argument("--skip-checks", action="store_true", help="only the burst (no paused-replica/Redis-down)")
    args = parser.parse_args()
    setup_django()
    ids = prepare_sessions(args.sessions)
    try:
        wait_for_replica()
        print(f"burst: {args.branches} branches x {args.sessions} sessions x {args.steps} steps, "
              f"{args.processes} processes x {args.threads} threads, writer {args.writes_per_s:g} updates/s")
        print(f"{'mode':9} {'reads':>7} {'s':>5} {'dbq/1000':>9} {'p50 ms':>7} {'p99 ms':>7} {'replica':>8} "
              f"{'local':>6} {'redis':>6} {'db':>6} {'errors':>6}")
        rows = {}
        for mode in args.modes.split(","):
            row = rows[mode] = run_burst(mode, ids, args)
            print(f"{mode:9} {row['reads']:7d} {row['seconds']:5.1f} {row['db_queries_per_1000']:9.3f} "
                  f"{row['p50_ms']:7.3f} {row['p99_ms']:7.3f} {row['replica_share_of_db_reads']:8.1%} "
                  f"{row['served_local']:6.1%} {row['served_redis']:6.1%} {row['served_db']:6.1%} {row['errors']:6d}",
                  flush=True)
        if args.skip_checks:
            return
        stale, checked = run_own_writes(ids, args)
        print(f"own writes with replica replay paused: {checked} read-backs (same and other process), {stale} stale")
        down = run_redis_down(ids, args)
        print(f"redis stopped mid-burst: {down['reads']} reads, {down['errors']} errors, "
              f"{down['reads_while_down']} reads while down served with {down['loads_while_down']} database loads, "
              f"{down['redis_hits_after_restart']} redis hits after the restart")
        two_tier = rows["two_tier"]
        local_p99 = rows["two_tier"]["p99_ms_local_hits"]
        print(f"two_tier reads served by the in-process tier: p99 {local_p99:.4f} ms")
        print(f"RESULT db_queries_per_1000={two_tier['db_queries_per_1000']:.3f} p99_ms_two_tier={two_tier['p99_ms']:.3f} "
              f"stale_own_reads={stale} errors_redis_down={down['errors']}")
    finally:
        replica_admin("SELECT pg_wal_replay_resume()")
        drop_sessions()


if __name__ == "__main__":
    main()
