"""The caller's read floor: the primary WAL position its own writes reached.

A read may go to a replica only if the replica has replayed at least this position, so a caller
always sees its own writes. The floor lives in a contextvar (one per thread, one per asyncio
task), so concurrent requests and worker threads never see each other's floor.

Reading the primary's position after every statement would double the round trips of a
write-heavy request. Instead a write only sets a flag (an execute wrapper on the primary's
connection, no round trip); the position is read once, lazily, when the first replica-eligible
read follows the write, or when the response is returned to the client (see
``metadata.replicas.middleware``), or for free when the cache's commit hook has just read it.

The floor is read with ``pg_logical_emit_message()`` (a tiny non-transactional WAL record,
no flush wait) rather than ``pg_current_wal_lsn()``: it returns a position strictly above any
position read before the call. A reader that read position P before its snapshot therefore saw
every write whose floor is <= P, even on an idle primary where ``pg_current_wal_lsn()`` would
return the same value before and after a commit became visible. That makes every comparison in
the router and the cache a plain ``floor <= position``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.signals import connection_created

PRIMARY_ALIAS = DEFAULT_DB_ALIAS
LSN_HEADER = "X-SpecOps-LSN"  # returned after a write; clients send it back on later requests
READ_DB_HEADER = "X-SpecOps-Read-DB"  # which databases/tiers served the request's reads (DEBUG, tests)
NO_LSN = 0

# First keywords of statements that change data (and so produce WAL the reader must wait for).
_WRITE_KEYWORDS = frozenset({"INSERT", "UPDATE", "DELETE", "MERGE", "COPY", "TRUNCATE", "WITH"})


def parse_lsn(text: str) -> int:
    """``'16/B374D848'`` -> an int that orders like the WAL position; ValueError if malformed."""
    high, sep, low = text.strip().partition("/")
    if not sep or not high or not low or len(high) > 8 or len(low) > 8:
        raise ValueError(f"{text!r} is not a PostgreSQL LSN (like 16/B374D848)")
    return (int(high, 16) << 32) | int(low, 16)


def format_lsn(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


@dataclass(frozen=True, slots=True)
class ReadFloor:
    """``lsn``: position the caller's writes are known to have reached; ``write_pending``: the
    caller wrote since ``lsn`` was captured, so the position must be read before the next replica
    read."""

    lsn: int = NO_LSN
    write_pending: bool = False


_floor: ContextVar[ReadFloor] = ContextVar("specops_read_floor", default=ReadFloor())
_force_primary: ContextVar[bool] = ContextVar("specops_force_primary", default=False)
_served_by: ContextVar[tuple[str, ...]] = ContextVar("specops_served_by", default=())


def current() -> ReadFloor:
    return _floor.get()


def note_write() -> None:
    """Record that the caller wrote to the primary (cheap: no round trip)."""
    floor = _floor.get()
    if not floor.write_pending:
        _floor.set(replace(floor, write_pending=True))


def raise_floor(lsn: int, writes_captured: bool = False) -> None:
    """Move the floor up to ``lsn``; ``writes_captured`` clears the pending flag (``lsn`` was read
    after every earlier write of this caller committed)."""
    floor = _floor.get()
    pending = floor.write_pending and not writes_captured
    if lsn > floor.lsn or pending != floor.write_pending:
        _floor.set(ReadFloor(max(lsn, floor.lsn), pending))


def capture_primary_lsn() -> int:
    """Read a floor on the primary: a position above every position read before (one round trip).

    Call it after the write committed. The message is non-transactional, so it waits for no
    flush; a replica reaches it within ``wal_writer_delay`` (reads go to the primary meanwhile).
    """
    with connections[PRIMARY_ALIAS].cursor() as cursor:
        cursor.execute("SELECT pg_logical_emit_message(false, 'specops.read_floor', '')::text")
        return parse_lsn(cursor.fetchone()[0])


def primary_position() -> int:
    """The primary's WAL insert position now (one round trip): every floor this server has
    handed out (``capture_primary_lsn``) is at or below it, so it bounds a floor a client sends."""
    with connections[PRIMARY_ALIAS].cursor() as cursor:
        cursor.execute("SELECT pg_current_wal_insert_lsn()::text")
        return parse_lsn(cursor.fetchone()[0])


def required_lsn() -> int:
    """The position a replica must have replayed to serve this caller (reads it if pending).

    Must not be called inside an open transaction on the primary: a position read before the
    commit would be below the commit record. The router sends such reads to the primary instead.
    """
    floor = _floor.get()
    if floor.write_pending:
        raise_floor(capture_primary_lsn(), writes_captured=True)
        return _floor.get().lsn
    return floor.lsn


@contextmanager
def floor_scope(lsn: int = NO_LSN) -> Iterator[None]:
    """Run a unit of work (a request, a task) with its own floor, starting at ``lsn``."""
    floor_token = _floor.set(ReadFloor(lsn))
    served_token = _served_by.set(())
    try:
        yield
    finally:
        _floor.reset(floor_token)
        _served_by.reset(served_token)


@contextmanager
def primary_only() -> Iterator[None]:
    """Send every read in the block to the primary (a retry after a replica failed, a check)."""
    token = _force_primary.set(True)
    try:
        yield
    finally:
        _force_primary.reset(token)


def primary_forced() -> bool:
    return _force_primary.get()


def note_served_by(source: str) -> None:
    """Remember which database or cache tier served a read (for the debug header and retries)."""
    served = _served_by.get()
    if source not in served:
        _served_by.set(served + (source,))


def served_by() -> tuple[str, ...]:
    return _served_by.get()


def _is_write(sql: str) -> bool:
    head = sql.lstrip()[:8].split(None, 1)
    return bool(head) and head[0].upper() in _WRITE_KEYWORDS


def _mark_writes(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict) -> Any:
    """Execute wrapper of the primary connection: flags the caller's floor after a write.

    A wrapper, not ``db_for_write``: writes made with an explicit ``using("default")``, raw SQL or
    ``bulk_create`` never ask the router, but all pass through here. ``WITH`` counts as a write
    (it may hide one); a false positive costs one extra position read, a miss a stale read.
    """
    result = execute(sql, params, many, context)
    if isinstance(sql, str) and _is_write(sql):
        note_write()
    return result


def install_write_marker(connection) -> None:
    if connection.alias == PRIMARY_ALIAS and _mark_writes not in connection.execute_wrappers:
        connection.execute_wrappers.append(_mark_writes)


def _on_connection_created(sender, connection, **kwargs) -> None:
    install_write_marker(connection)


connection_created.connect(_on_connection_created, dispatch_uid="specops_lsn_write_marker")
