"""Database plumbing shared by partition and index maintenance: locks, timeouts, literals.

Maintenance must never queue the application's writers behind an exclusive lock for long, so
every DDL statement runs under a short ``lock_timeout`` and is retried with backoff; and two
maintenance runs must never overlap, so each run holds a ``pg_try_advisory_lock`` on a
connection of its own (closing that connection, or the process dying, releases it).
"""
from __future__ import annotations

import contextlib
import datetime as dt
import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import psycopg
from django.db import DEFAULT_DB_ALIAS, OperationalError, connections, transaction
from psycopg import sql

from metadata.conf import conf
from metadata.partitions.errors import (
    BoundsError,
    ConcurrentDDLInTransaction,
    LockRetriesExhausted,
    MaintenanceLockBusy,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Advisory lock keys (one bigint namespace per database); fixed so every process agrees.
PARTITION_MAINTENANCE_LOCK = 0x5350_4543_0001  # "SPEC" + 1
RECENT_INDEX_LOCK = 0x5350_4543_0002

LOCK_NOT_AVAILABLE = "55P03"


def lock_timeout_ms() -> int:
    return int(conf.MAINTENANCE_LOCK_TIMEOUT_MS)


def lock_retries() -> int:
    return int(conf.MAINTENANCE_LOCK_RETRIES)


def quote(name: str, using: str = DEFAULT_DB_ALIAS) -> str:
    """Quote an identifier (table, index, constraint) for the SQL we compose."""
    return connections[using].ops.quote_name(name)


def literal(value: object, using: str = DEFAULT_DB_ALIAS) -> str:
    """Render a value as a SQL literal, for DDL where bind parameters are not allowed.

    Datetimes are rendered in UTC with an explicit offset, so the session's TimeZone cannot
    shift a partition bound or an index cutoff.
    """
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise BoundsError("naive datetime in DDL")
        return f"'{value.astimezone(dt.timezone.utc).isoformat()}'::timestamptz"
    conn = connections[using]
    conn.ensure_connection()
    return sql.Literal(value).as_string(conn.connection)


def is_lock_timeout(exc: BaseException) -> bool:
    cause = exc.__cause__ if isinstance(exc, OperationalError) else exc
    return getattr(cause, "sqlstate", None) == LOCK_NOT_AVAILABLE


def _backoff(attempt: int) -> float:
    """Jittered exponential backoff, capped: writers get the table back between attempts."""
    return min(2.0, 0.05 * 2**attempt) * (0.5 + random.random())


def _retry_on_lock_timeout(attempt_once: Callable[[], T], what: str) -> T:
    """Call ``attempt_once`` until it does not time out on a lock, at most ``lock_retries()`` more times."""
    retries = lock_retries()
    for attempt in range(retries + 1):
        try:
            return attempt_once()
        except OperationalError as exc:
            if not is_lock_timeout(exc):
                raise
            if attempt == retries:
                raise LockRetriesExhausted(f"{what}: no lock after {retries + 1} attempts") from exc
            logger.info("%s: lock timeout, retry %d/%d", what, attempt + 1, retries)
            time.sleep(_backoff(attempt))
    raise AssertionError("unreachable")


def with_lock_retries(action: Callable[[], T], what: str, using: str = DEFAULT_DB_ALIAS) -> T:
    """Run ``action`` in a transaction with ``SET LOCAL lock_timeout``; retry on lock timeout.

    ``action`` must be safe to rerun: a lock timeout rolls its transaction back.
    """

    def attempt_once() -> T:
        with transaction.atomic(using=using):
            with connections[using].cursor() as cursor:
                cursor.execute(f"SET LOCAL lock_timeout = {lock_timeout_ms()}")
            return action()

    return _retry_on_lock_timeout(attempt_once, what)


def autocommit_with_lock_retries(statement: str, what: str, using: str = DEFAULT_DB_ALIAS) -> None:
    """Run one statement that refuses a transaction block (``... CONCURRENTLY``), with retries."""
    conn = connections[using]
    if conn.in_atomic_block:
        raise ConcurrentDDLInTransaction(f"{what} cannot run inside a transaction (it uses CONCURRENTLY)")

    def attempt_once() -> None:
        with conn.cursor() as cursor:
            cursor.execute(f"SET lock_timeout = {lock_timeout_ms()}")
            try:
                cursor.execute(statement)
            finally:
                cursor.execute("RESET lock_timeout")

    _retry_on_lock_timeout(attempt_once, what)


@contextlib.contextmanager
def advisory_lock(key: int, using: str = DEFAULT_DB_ALIAS) -> Iterator[None]:
    """Hold ``pg_try_advisory_lock(key)`` for the block, or raise ``MaintenanceLockBusy`` at once.

    The lock lives on a dedicated, unpooled connection: a pooled connection handed back with a
    session lock still held would block every later run.
    """
    params = connections[using].settings_dict
    lock_conn = psycopg.connect(
        dbname=params["NAME"],
        user=params.get("USER") or None,
        password=params.get("PASSWORD") or None,
        host=params.get("HOST") or None,
        port=params.get("PORT") or None,
        autocommit=True,
        application_name="specops-maintenance-lock",
    )
    try:
        (acquired,) = lock_conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
        if not acquired:
            raise MaintenanceLockBusy("another maintenance run holds the lock; try again later")
        try:
            yield
        finally:
            lock_conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
    finally:
        lock_conn.close()
