"""Data loading and writer processes for bench/metadata.py (kept apart: spawn re-imports it)."""
from __future__ import annotations

import datetime as dt
import os
import time
import uuid

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
    """``count`` finished sessions active over 30 days, ``recent`` of them in the last 20 minutes."""
    return execute(
        "INSERT INTO metadata_session (id, tenant_id, created_at, updated_at, last_activity_at, status, target_id, "
        "drafter, queue, prompt, prompt_tokens, params, token_count, text, finish_reason, error, stats) "
        "SELECT gen_random_uuid(), %s, t, t, t, 'succeeded', %s, 'tree', 'cpu', 'bench', 8, '{}', 64, '', "
        "'length', '', '{}' FROM ("
        "  SELECT %s - interval '1 hour' - random() * interval '30 days' AS t FROM generate_series(1, %s - %s)"
        "  UNION ALL SELECT %s - random() * interval '20 minutes' FROM generate_series(1, %s)) picked",
        [tenant_id, target_id, now, count, recent, now, recent],
    )


def writer_process(url: str, archive_dir: str, created: dt.datetime, stop, results) -> None:
    """Write sessions of 300 tokens through the real batched writer until ``stop``; report
    (commit time, rows) per batch. Runs in its own process: Python threads would share one GIL
    with the rotation being measured."""
    setup_django(url, archive_dir)
    from metadata.models import TokenKind, TokenRecord
    from metadata.sessions.writers import insert_ignoring_conflicts

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


def rows_between(batches: list[tuple[float, int]], start: float, end: float) -> int:
    return sum(rows for at, rows in batches if start <= at < end)
