"""Data loading, row counts and writer processes for bench/metadata.py (kept apart: spawn re-imports it)."""
from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Callable

BENCH_DB = "specops_bench"


def bench_environment(url: str, archive_dir: str) -> None:
    """Point Django at the bench database (no replica) before it is set up."""
    os.environ["DATABASE_URL"] = url
    os.environ["DATABASE_REPLICA_URLS"] = ""
    os.environ["SPECOPS_ARCHIVE_DIR"] = archive_dir
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "specops.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")


def setup_django(url: str, archive_dir: str) -> None:
    bench_environment(url, archive_dir)
    import django

    django.setup()


def execute(sql: str, params: list | None = None) -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def count(table: str, where: str = "", params: list | None = None) -> int:
    """Rows of ``table`` (``where``: an SQL filter): what the figures check loaded and lost rows by."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {table} {where}", params)
        return cursor.fetchone()[0]


def load_tokens(day_start: dt.datetime, sessions: int, tokens_per_session: int) -> int:
    """``sessions`` sessions of ``tokens_per_session`` tokens created during that UTC day."""
    return execute(
        "INSERT INTO metadata_token (session_id, session_created_at, position, step, token_id, piece, kind, logprob) "
        "SELECT s.id, s.created, g, g / 3, (g * 7919) %% 50257, 'tok' || g, g %% 3, -random() "
        "FROM (SELECT gen_random_uuid() AS id, %s + random() * interval '23 hours' AS created "
        "      FROM generate_series(1, %s)) s CROSS JOIN generate_series(0, %s - 1) g",
        [day_start, sessions, tokens_per_session],
    )


def load_big_session_candidates(session_id: uuid.UUID, created: dt.datetime, steps: int, branches: int) -> int:
    """One long session's n-best candidates; scores with three decimals, so many ties."""
    return execute(
        "INSERT INTO metadata_candidate (session_id, session_created_at, step, branch, token_ids, score, accepted_len) "
        "SELECT %s, %s, s, b, jsonb_build_array(s, b), round(random()::numeric, 3)::float8, b %% 4 "
        "FROM generate_series(0, %s - 1) s CROSS JOIN generate_series(0, %s - 1) b",
        [session_id, created, steps, branches],
    )


def load_sessions(tenant_id: int, target_id: int, count: int, recent: int, now: dt.datetime) -> int:
    """``count`` finished sessions active over 30 days, ``recent`` of them in the last 20 minutes;
    ids are UUIDv7 of their created_at, as the application makes them."""
    return execute(
        "INSERT INTO metadata_session (id, tenant_id, created_at, updated_at, last_activity_at, status, target_id, "
        "drafter, queue, prompt, prompt_tokens, params, token_count, text, finish_reason, error, stats, attempts, "
        f"worker) SELECT {uuid7_sql('t')}, %s, t, t, t, 'succeeded', %s, 'tree', 'cpu', 'bench', 8, '{{}}', 64, '', "
        "'length', '', '{}', 0, '' FROM (SELECT date_trunc('milliseconds', t) AS t FROM ("
        "  SELECT %s - interval '1 hour' - random() * interval '30 days' AS t FROM generate_series(1, %s - %s)"
        "  UNION ALL SELECT %s - random() * interval '20 minutes' FROM generate_series(1, %s)) raw) picked",
        [tenant_id, target_id, now, count, recent, now, recent],
    )


def writer_process(url: str, archive_dir: str, created: dt.datetime, stop, results) -> None:
    """Write sessions of 300 tokens through the real batched writer until ``stop``; report
    (commit time, rows) per batch. Runs in its own process: Python threads would share one GIL
    with the rotation being measured."""
    setup_django(url, archive_dir)
    from metadata.models import TokenKind, TokenRecord
    from metadata.history import insert_ignoring_conflicts

    batches: list[tuple[float, int]] = []
    batch_size = 100
    while not stop.is_set():
        session_id = uuid.uuid4()
        for start in range(0, 300, batch_size):
            rows = [TokenRecord(session_id=session_id, session_created_at=created, position=p, step=p // 3,
                                token_id=p, piece=f"t{p}", kind=TokenKind.ACCEPTED, logprob=-0.1)
                    for p in range(start, start + batch_size)]
            written = insert_ignoring_conflicts(TokenRecord, rows, batch_size=batch_size)  # one transaction
            batches.append((time.time(), written))
    results.put(batches)


class WriterProcesses:
    """``count`` processes of ``target(*args, stop, results)``, started at once; each writes until
    ``finish()`` stops it and reports once. Processes, not threads: threads would share one GIL
    with the maintenance being measured."""

    def __init__(self, target: Callable[..., None], args: tuple, count: int) -> None:
        ctx = mp.get_context("spawn")
        self.stop, self.results = ctx.Event(), ctx.Queue()
        self.processes = [ctx.Process(target=target, args=(*args, self.stop, self.results)) for _ in range(count)]
        for process in self.processes:
            process.start()

    def finish(self) -> list:
        """Stop every writer; their reports."""
        self.stop.set()
        reports = [self.results.get(timeout=120) for _ in self.processes]
        for process in self.processes:
            process.join()
        return reports


def rows_between(batches: list[tuple[float, int]], start: float, end: float) -> int:
    return sum(rows for at, rows in batches if start <= at < end)


# ------------------------------------------------------------------ partitioned sessions (issue 16)
def uuid7_sql(moment: str) -> str:
    """SQL for a UUIDv7 of ``moment`` (a timestamptz expression already truncated to the millisecond),
    as ``metadata.ids.uuid7`` makes it: 48 bits of Unix milliseconds, version 7, variant 10, and
    the rest random (hex digits 14-16 and 18-32 of a random v4 UUID, which skip its version and
    variant digits)."""
    rand = "replace(gen_random_uuid()::text, '-', '')"
    return (f"(lpad(to_hex(floor(extract(epoch FROM {moment}) * 1000)::bigint), 12, '0') || '7' "
            f"|| substr({rand}, 14, 3) || to_hex(8 + floor(random() * 4)::int) || substr({rand}, 18, 15))::uuid")


# Shaped like metadata_session (metadata.models.Session): its columns, less the foreign keys.
BENCH_SESSION_COLUMNS = """
    id uuid NOT NULL, tenant_id bigint NOT NULL, created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL,
    last_activity_at timestamptz NOT NULL, status varchar(16) NOT NULL, target_id bigint NOT NULL,
    drafter varchar(16) NOT NULL, queue varchar(32) NOT NULL, prompt text NOT NULL,
    prompt_tokens integer NOT NULL CHECK (prompt_tokens >= 0), params jsonb NOT NULL,
    token_count integer NOT NULL CHECK (token_count >= 0), text text NOT NULL, finish_reason varchar(16) NOT NULL,
    error text NOT NULL, stats jsonb NOT NULL, started_at timestamptz, finished_at timestamptz"""
BENCH_SESSION_INDEXES = (  # metadata.models.Session.Meta.indexes, with a suffix per table
    "CREATE INDEX {table}_state_covering ON {table} (id) INCLUDE (status, token_count, updated_at, tenant_id)",
    "CREATE INDEX {table}_live_partial ON {table} (last_activity_at) WHERE status IN ('queued', 'running')",
    "CREATE INDEX {table}_tenant_recent ON {table} (tenant_id, created_at DESC, id)",
)


def create_bench_sessions(table: str, partitions: list[tuple[str, dt.datetime, dt.datetime]] | None) -> None:
    """``table`` shaped like metadata_session: RANGE-partitioned on created_at (``partitions``: name,
    start, end, plus a DEFAULT) with the key (id, created_at), or plain with the key (id)."""
    if partitions is None:
        execute(f"CREATE TABLE {table} ({BENCH_SESSION_COLUMNS}, PRIMARY KEY (id))")
        return
    execute(f"CREATE TABLE {table} ({BENCH_SESSION_COLUMNS}, PRIMARY KEY (id, created_at)) "
            f"PARTITION BY RANGE (created_at)")
    execute(f"CREATE TABLE {table}_default PARTITION OF {table} DEFAULT")
    for name, start, end in partitions:
        execute(f"CREATE TABLE {name} PARTITION OF {table} FOR VALUES FROM (%s) TO (%s)", [start, end])


def index_bench_sessions(table: str) -> None:
    for statement in BENCH_SESSION_INDEXES:
        execute(statement.format(table=table))
    execute(f"VACUUM (ANALYZE) {table}")


def load_bench_sessions(table: str, day_start: dt.datetime, until: dt.datetime, count: int, live: int) -> int:
    """``count`` sessions created in ``[day_start, until)`` with UUIDv7 ids of their created_at,
    ``live`` of them queued or running (the rest finished)."""
    return execute(
        f"INSERT INTO {table} (id, tenant_id, created_at, updated_at, last_activity_at, status, target_id, drafter, "
        f"queue, prompt, prompt_tokens, params, token_count, text, finish_reason, error, stats, started_at, "
        f"finished_at) "
        f"SELECT {uuid7_sql('t')}, 1 + g %% 50, t, t, t, CASE WHEN g <= %s THEN (ARRAY['queued', 'running'])[1 + g %% 2] "
        f"ELSE 'succeeded' END, 1, 'tree', 'cpu', 'bench prompt ' || g, 8, '{{}}', 64, repeat('x', 64), 'length', '', "
        f"'{{}}', t, t FROM (SELECT g, date_trunc('milliseconds', %s + random() * (%s - %s)) AS t "
        f"FROM generate_series(1, %s) g) s",
        [live, day_start, until, day_start, count],
    )


def session_writer_process(url: str, table: str, ids: list[str], stop, results) -> None:
    """Write to ``table`` until ``stop``: each transaction inserts 5 new sessions (UUIDv7 of now) and
    adds 1 to one existing session's token_count; report (commit time, inserted, updated) per
    transaction and every error (writers should see none)."""
    import random

    import psycopg

    rng = random.Random(os.getpid())
    commits: list[tuple[float, int, int]] = []
    errors: list[str] = []
    insert = (f"INSERT INTO {table} (id, tenant_id, created_at, updated_at, last_activity_at, status, target_id, "
              f"drafter, queue, prompt, prompt_tokens, params, token_count, text, finish_reason, error, stats) "
              f"SELECT {uuid7_sql('t')}, 1, t, t, t, 'queued', 1, 'tree', 'cpu', 'writer', 8, '{{}}', 0, '', '', '', "
              f"'{{}}' FROM (SELECT date_trunc('milliseconds', clock_timestamp()) AS t "
              f"FROM generate_series(1, 5)) s")
    update = f"UPDATE {table} SET token_count = token_count + 1, updated_at = now() WHERE id = %s"
    with psycopg.connect(url, autocommit=True) as conn:
        while not stop.is_set():
            try:
                with conn.transaction():
                    inserted = conn.execute(insert).rowcount
                    updated = conn.execute(update, (rng.choice(ids),)).rowcount
                commits.append((time.time(), inserted, updated))
            except psycopg.Error as exc:
                errors.append(" ".join(str(exc).split()))
            time.sleep(0.002)
    results.put((commits, errors))
