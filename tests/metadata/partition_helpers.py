"""Helpers for partition tests: reset the partitioned tables, load rows fast, count them."""
from __future__ import annotations

import datetime as dt
import threading
import uuid

from django.db import connection

from metadata.models import PARTITIONED_TABLES
from metadata.partitions import catalog, existing_indexes

UTC = dt.timezone.utc


class BackgroundThreads:
    """``threads`` started on entering; ``stop`` set and the threads joined on leaving."""

    threads: list[threading.Thread]
    stop: threading.Event

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def day(n: int, hour: int = 0) -> dt.datetime:
    """Midnight UTC of day ``n`` after 2030-01-01 (a fixed, far-from-now test calendar)."""
    return dt.datetime(2030, 1, 1, tzinfo=UTC) + dt.timedelta(days=n, hours=hour)


def reset_partitions() -> None:
    """Drop every range partition, staging or restored table and recent index; empty DEFAULT.

    Schema changes survive pytest-django's flush, so each partition test starts from this.
    """
    with connection.cursor() as cursor:
        for parent in PARTITIONED_TABLES:
            for p in catalog.list_partitions(parent):
                if p.is_default:
                    cursor.execute(f'TRUNCATE "{p.name}"')
                else:
                    cursor.execute(f'DROP TABLE "{p.name}"')
            cursor.execute(
                "SELECT relname FROM pg_class WHERE relkind = 'r' AND NOT relispartition "
                "AND (relname LIKE %s OR relname LIKE 'restored\\_%%')",
                [parent + "\\_p%"],
            )
            for (name,) in cursor.fetchall():
                cursor.execute(f'DROP TABLE "{name}"')
        for index in existing_indexes():
            cursor.execute(f'DROP INDEX "{index.name}"')
        cursor.execute("TRUNCATE metadata_partitionarchivaljob")


def insert_tokens(created_at: dt.datetime, count: int, session_id: uuid.UUID | None = None) -> uuid.UUID:
    """Insert ``count`` token rows of one session created at ``created_at`` (one statement)."""
    session_id = session_id or uuid.uuid4()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO metadata_token (session_id, session_created_at, position, step, token_id, piece, kind, logprob) "
            "SELECT %s, %s, g, g / 4, g %% 50257, 'tok' || g, g %% 3, -g / 1000.0 FROM generate_series(0, %s - 1) g",
            [session_id, created_at, count],
        )
    return session_id


def insert_candidates(created_at: dt.datetime, count: int) -> uuid.UUID:
    session_id = uuid.uuid4()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO metadata_candidate (session_id, session_created_at, step, branch, token_ids, score, accepted_len) "
            "SELECT %s, %s, g / 3, g %% 3, jsonb_build_array(g, g + 1), (g %% 17) / 4.0, g %% 4 "
            "FROM generate_series(0, %s - 1) g",
            [session_id, created_at, count],
        )
    return session_id


def row_count(table: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT count(*) FROM "{table}"')
        return cursor.fetchone()[0]


def token_keys(table: str = "metadata_token") -> set[tuple[str, int]]:
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT session_id::text, position FROM "{table}"')
        return set(cursor.fetchall())
