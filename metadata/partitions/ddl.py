"""The DDL of making and attaching a partition: the one ATTACH with a CHECK on its bounds.

A table is attached as a partition only after a CHECK constraint proves its rows lie in the
bounds, so ``ATTACH PARTITION`` skips the scan it would otherwise make under its lock; the CHECK is
dropped once attached (the partition bound now says the same). The ATTACH runs in the caller's
transaction, after ``LOCK ... IN SHARE MODE`` on the parent: inserts wait for these few
milliseconds, reads do not. Without that lock an insert that had routed a row of the new range to
DEFAULT just before the ATTACH fails just after it ("violates partition constraint": its
partition descriptor predates the ATTACH). ``CREATE TABLE ... PARTITION OF`` is never used: it
holds ACCESS EXCLUSIVE on the parent, blocking reads too.

The parent's indexes (and its primary key) are built on the standalone table before the ATTACH
(``build_parent_indexes``): nobody else uses that table yet, so the build blocks no one, and the
ATTACH finds an equivalent index for each and only attaches it, instead of building them all
while it holds SHARE on the parent (which would stall every insert for the length of the build).
"""
from __future__ import annotations

import re
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


_INDEX_DEF = re.compile(r"^CREATE (UNIQUE )?INDEX \S+ ON (?:ONLY )?\S+ (USING .*)$", re.DOTALL)


def build_parent_indexes(parent: str, table: str, using: str = DEFAULT_DB_ALIAS) -> list[str]:
    """Build each index and the primary key of ``parent`` on the standalone ``table``; the names made.

    Constraint indexes (the primary key) are made as constraints, which is what an ATTACH
    matches them to; the others from ``pg_get_indexdef`` with the table and the name changed.
    An index the table already has (a rerun after a crash) is kept.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_indexdef(i.indexrelid), pg_get_constraintdef(con.oid) "
            "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid AND con.conrelid = i.indrelid "
            "WHERE i.indrelid = to_regclass(%s) ORDER BY c.relname",
            [parent],
        )
        definitions = cursor.fetchall()
        cursor.execute("SELECT count(*) FROM pg_index WHERE indrelid = to_regclass(%s)", [table])
        if cursor.fetchone()[0]:
            return []  # built by an earlier run of this make
        made = []
        for number, (index_def, constraint_def) in enumerate(definitions, start=1):
            name = f"{table[:55]}_ix{number}"
            if constraint_def:
                cursor.execute(f"ALTER TABLE {quote(table, using)} ADD CONSTRAINT {quote(name, using)} {constraint_def}")
            else:
                match = _INDEX_DEF.match(index_def)
                if match is None:
                    continue  # a form this does not rewrite: the ATTACH builds that one itself
                unique, rest = match.groups()
                cursor.execute(f"CREATE {unique or ''}INDEX {quote(name, using)} ON {quote(table, using)} {rest}")
            made.append(name)
    return made


def create_checked_table(parent: str, table: str, column: str, bounds: TimeRange, comment: str = "",
                         using: str = DEFAULT_DB_ALIAS) -> None:
    """A standalone table shaped like ``parent`` with the CHECK of ``bounds`` (indexes: ``build_parent_indexes``)."""
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
