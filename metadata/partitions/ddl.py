"""The DDL of making and attaching a partition: the one ATTACH with a CHECK on its bounds.

A table is attached as a partition only after a CHECK constraint proves its rows lie in the
bounds, so ``ATTACH PARTITION`` skips the scan it would otherwise make under its lock; the CHECK is
dropped once attached (the partition bound now says the same). The ATTACH runs in the caller's
transaction, after ``LOCK ... IN SHARE MODE`` on the parent: inserts wait for these few
milliseconds, reads do not. Without that lock an insert that had routed a row of the new range to
DEFAULT just before the ATTACH fails just after it ("violates partition constraint": its
partition descriptor predates the ATTACH). ``CREATE TABLE ... PARTITION OF`` is never used: it
holds ACCESS EXCLUSIVE on the parent, blocking reads too.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from django.db import DEFAULT_DB_ALIAS, connections

from metadata.partitions.bounds import TimeRange
from metadata.partitions.locks import literal, quote

T = TypeVar("T")


def bound_constraint(table: str) -> str:
    return table[:55] + "_bound"


def add_bound_check(table: str, column: str, bounds: TimeRange, using: str = DEFAULT_DB_ALIAS) -> None:
    """CHECK that every row of ``table`` lies in ``bounds`` (scans ``table``, which nobody else uses yet)."""
    col = quote(column, using)
    with connections[using].cursor() as cursor:
        cursor.execute(
            f"ALTER TABLE {quote(table, using)} ADD CONSTRAINT {quote(bound_constraint(table), using)} CHECK ("
            f"{col} IS NOT NULL AND {col} >= {literal(bounds.start)} AND {col} < {literal(bounds.end)})"
        )


def create_checked_table(parent: str, table: str, column: str, bounds: TimeRange, comment: str = "",
                         using: str = DEFAULT_DB_ALIAS) -> None:
    """A standalone table shaped like ``parent`` with the CHECK of ``bounds`` (indexes come at ATTACH)."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE {quote(table, using)} "
            f"(LIKE {quote(parent, using)} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
        )
    add_bound_check(table, column, bounds, using)
    if comment:
        with connections[using].cursor() as cursor:
            cursor.execute(f"COMMENT ON TABLE {quote(table, using)} IS {literal(comment, using)}")


def attach_checked_table(parent: str, table: str, bounds: TimeRange, using: str = DEFAULT_DB_ALIAS,
                         before_attach: Callable[[object], T] | None = None) -> T | None:
    """In the caller's transaction: SHARE on ``parent``, ``before_attach(cursor)``, ATTACH, drop the CHECK.

    Run it under ``with_lock_retries``: it waits for locks. ``before_attach`` runs once the parent
    is locked (the rotation moves the DEFAULT partition's last stragglers there); its result is
    returned.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(f"LOCK TABLE {quote(parent, using)} IN SHARE MODE")
        result = before_attach(cursor) if before_attach else None
        cursor.execute(
            f"ALTER TABLE {quote(parent, using)} ATTACH PARTITION {quote(table, using)} "
            f"FOR VALUES FROM ({literal(bounds.start)}) TO ({literal(bounds.end)})"
        )
        cursor.execute(f"ALTER TABLE {quote(table, using)} DROP CONSTRAINT IF EXISTS "
                       f"{quote(bound_constraint(table), using)}")
    return result
