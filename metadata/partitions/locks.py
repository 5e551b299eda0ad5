"""Database plumbing shared by partition and index maintenance: locks, timeouts, literals.

Maintenance must never queue the application's writers behind an exclusive lock for long, so
every DDL statement runs under a short ``lock_timeout`` and is retried with backoff; and two
maintenance runs must never overlap, so each run holds a ``pg_try_advisory_lock`` on a
connection of its own (closing that connection, or the process dying, releases it).

``DATABASE_URL`` may point at PgBouncer in transaction mode, where no session state survives a
transaction: the advisory lock and the statements that need a session (``SET lock_timeout`` around
a ``... CONCURRENTLY``) then go to the ``direct`` alias (``DATABASE_DIRECT_URL``, see
``session_alias``), each on a connection of their own; ``SET LOCAL`` in a transaction works anywhere.
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
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, OperationalError, connections, transaction
from django.db.utils import load_backend
from psycopg import sql

from metadata.conf import conf
from metadata.partitions.errors import (
    BoundsError,
    ConcurrentDDLInTransaction,
    LockRetriesExhausted,
    MaintenanceLockBusy,
)
from core.database_config import maintenance_alias

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


def session_alias(using: str = DEFAULT_DB_ALIAS) -> str:
    """Where statements that need a session of their own go: ``direct`` for the primary when set."""
    return maintenance_alias(settings.DATABASES) if using == DEFAULT_DB_ALIAS else using


def session_settings(using: str = DEFAULT_DB_ALIAS) -> dict:
    """Connection settings for session-state statements on ``using``'s database.

    The ``direct`` alias reaches the same database as ``default`` by another route, so its name is
    always ``default``'s (a test database included, even while it is being migrated).
    """
    alias = session_alias(using)
    params = connections[alias].settings_dict
    return params if alias == using else {**params, "NAME": connections[using].settings_dict["NAME"]}


@contextlib.contextmanager
def session_connection(using: str = DEFAULT_DB_ALIAS) -> Iterator:
    """The connection for session-state statements: ``using``'s own, or a fresh, closed-after-use
    one on the ``direct`` alias (never one that a pool or another caller could share)."""
    alias = session_alias(using)
    if alias == using:
        yield connections[using]
        return
    params = session_settings(using)
    # A wrapper of its own, under a name of its own: not the alias's thread-local connection.
    conn = load_backend(params["ENGINE"]).DatabaseWrapper(params, f"{alias}-session")
    try:
        yield conn
    finally:
        conn.close()


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
    if connections[using].in_atomic_block:
        raise ConcurrentDDLInTransaction(f"{what} cannot run inside a transaction (it uses CONCURRENTLY)")

    def attempt_once() -> None:
        with session_connection(using) as conn, conn.cursor() as cursor:
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
    session lock still held would block every later run. For the primary it goes to the
    ``direct`` alias when one is set: through a transaction pooler the unlock could reach
    another server session than the lock.
    """
    params = session_settings(using)
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
