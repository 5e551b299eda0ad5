"""What partitions exist, read from pg_catalog by their bounds (never inferred from names).

``pg_get_expr(relpartbound)`` renders bounds in the session's TimeZone; the values are cast back
to ``timestamptz`` in the same query, so the result is an exact instant whatever that zone is.
"""
from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass

from django.db import DEFAULT_DB_ALIAS, connections

from metadata.partitions.bounds import BIN_ORIGIN, UTC, TimeRange

UNBOUNDED_START = dt.datetime.min.replace(tzinfo=UTC)
UNBOUNDED_END = dt.datetime.max.replace(tzinfo=UTC)
STAGING_MARK = "specops_staging_for"

_PARTITIONS_SQL = r"""
SELECT c.relname,
       pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT' AS is_default,
       i.inhdetachpending,
       CASE WHEN b.m[1] IS NULL OR b.m[1] = 'MINVALUE' THEN NULL ELSE btrim(b.m[1], '''')::timestamptz END,
       CASE WHEN b.m[2] IS NULL OR b.m[2] = 'MAXVALUE' THEN NULL ELSE btrim(b.m[2], '''')::timestamptz END,
       coalesce(s.n_live_tup, greatest(c.reltuples, 0))::bigint,
       CASE WHEN %s THEN pg_total_relation_size(c.oid) ELSE 0 END
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
CROSS JOIN LATERAL (
    SELECT regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \((.+)\) TO \((.+)\)') AS m
) b
WHERE i.inhparent = to_regclass(%s)
ORDER BY 4 NULLS FIRST, 1
"""


@dataclass(frozen=True)
class PartitionInfo:
    """One partition as the catalog sees it. ``bounds`` is None for the DEFAULT partition."""

    name: str
    parent: str
    bounds: TimeRange | None
    is_default: bool
    detach_pending: bool
    estimated_rows: int  # live tuples from the statistics system: cheap, a little behind
    total_bytes: int  # 0 unless listed with sizes=True


@dataclass(frozen=True)
class DefaultPartitionState:
    """What sits in the DEFAULT partition: rows nobody made a partition for (yet)."""

    name: str
    rows: int
    oldest: dt.datetime | None
    newest: dt.datetime | None
    total_bytes: int


def _cursor(using: str):
    return connections[using].cursor()


def list_partitions(parent: str, using: str = DEFAULT_DB_ALIAS, sizes: bool = False) -> list[PartitionInfo]:
    """Every partition attached to ``parent`` (default included), ordered by range start.

    ``sizes`` adds ``pg_total_relation_size`` (a stat() of every file of every partition): for
    people, not for the rotation's many lookups.
    """
    with _cursor(using) as cursor:
        cursor.execute(_PARTITIONS_SQL, [sizes, parent])
        rows = cursor.fetchall()
    result = []
    for name, is_default, pending, start, end, estimate, size in rows:
        bounds = None
        if not is_default:
            bounds = TimeRange(start or UNBOUNDED_START, end or UNBOUNDED_END)
        result.append(PartitionInfo(name, parent, bounds, bool(is_default), bool(pending), estimate, size))
    return result


def range_partitions(parent: str, using: str = DEFAULT_DB_ALIAS, sizes: bool = False) -> list[PartitionInfo]:
    return [p for p in list_partitions(parent, using, sizes) if not p.is_default]


def default_partition(parent: str, using: str = DEFAULT_DB_ALIAS, sizes: bool = False) -> PartitionInfo | None:
    return next((p for p in list_partitions(parent, using, sizes) if p.is_default), None)


def partition_covering(parent: str, moment: dt.datetime, using: str = DEFAULT_DB_ALIAS) -> PartitionInfo | None:
    return next((p for p in range_partitions(parent, using) if p.bounds.contains(moment)), None)


def expired_partitions(parent: str, cutoff: dt.datetime, using: str = DEFAULT_DB_ALIAS) -> list[PartitionInfo]:
    """Attached range partitions that end at or before ``cutoff`` (oldest first)."""
    return [p for p in range_partitions(parent, using) if p.bounds.end <= cutoff]


def default_rows_in(parent: str, column: str, ranges: list[TimeRange], using: str = DEFAULT_DB_ALIAS) -> list[int]:
    """Rows of the DEFAULT partition in each of ``ranges`` (one query; zeros when there is no DEFAULT)."""
    default = default_partition(parent, using)
    if default is None or not ranges:
        return [0] * len(ranges)
    conn = connections[using]
    col = conn.ops.quote_name(column)
    with _cursor(using) as cursor:
        cursor.execute(
            f"SELECT r.n, count(d.{col}) FROM unnest(%s::timestamptz[], %s::timestamptz[]) "
            f"WITH ORDINALITY AS r(s, e, n) LEFT JOIN {conn.ops.quote_name(default.name)} d "
            f"ON d.{col} >= r.s AND d.{col} < r.e GROUP BY r.n ORDER BY r.n",
            [[r.start for r in ranges], [r.end for r in ranges]],
        )
        return [count for _, count in cursor.fetchall()]


def default_state(parent: str, column: str, using: str = DEFAULT_DB_ALIAS) -> DefaultPartitionState | None:
    """Exact row count and key span of the DEFAULT partition (kept small by draining)."""
    default = default_partition(parent, using, sizes=True)
    if default is None:
        return None
    conn = connections[using]
    with _cursor(using) as cursor:
        cursor.execute(
            f"SELECT count(*), min({conn.ops.quote_name(column)}), max({conn.ops.quote_name(column)}) "
            f"FROM {conn.ops.quote_name(default.name)}"
        )
        rows, oldest, newest = cursor.fetchone()
    return DefaultPartitionState(default.name, rows, oldest, newest, default.total_bytes)


def default_bins(
    parent: str, column: str, width: dt.timedelta, limit: int, using: str = DEFAULT_DB_ALIAS
) -> list[tuple[TimeRange, int]]:
    """The aligned bins that rows in the DEFAULT partition fall in, with their row counts."""
    default = default_partition(parent, using)
    if default is None:
        return []
    conn = connections[using]
    with _cursor(using) as cursor:
        cursor.execute(
            f"SELECT date_bin(%s, {conn.ops.quote_name(column)}, %s) AS bin, count(*) "
            f"FROM {conn.ops.quote_name(default.name)} GROUP BY 1 ORDER BY 1 LIMIT %s",
            [width, BIN_ORIGIN, limit],
        )
        return [(TimeRange(start, start + width), count) for start, count in cursor.fetchall()]


def table_columns(table: str, using: str = DEFAULT_DB_ALIAS) -> list[str]:
    """Column names in their logical order (dropped columns skipped)."""
    with _cursor(using) as cursor:
        cursor.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) "
            "AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            [table],
        )
        return [name for (name,) in cursor.fetchall()]


def relation_exists(name: str, using: str = DEFAULT_DB_ALIAS) -> bool:
    with _cursor(using) as cursor:
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
        return bool(cursor.fetchone()[0])


def is_partitioned(name: str, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Is ``name`` a partitioned table (relkind ``p``)?"""
    with _cursor(using) as cursor:
        cursor.execute("SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass(%s)", [name])
        row = cursor.fetchone()
    return bool(row and row[0])


def relation_oid(name: str, using: str = DEFAULT_DB_ALIAS) -> int | None:
    """The OID of the relation called ``name`` now (None if there is none)."""
    with _cursor(using) as cursor:
        cursor.execute("SELECT to_regclass(%s)::oid", [name])
        value = cursor.fetchone()[0]
    return int(value) if value is not None else None


def attachment(name: str, using: str = DEFAULT_DB_ALIAS) -> tuple[str, bool] | None:
    """(parent, detach pending) if ``name`` is attached to a partitioned table, else None."""
    with _cursor(using) as cursor:
        cursor.execute(
            "SELECT p.relname, i.inhdetachpending FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhparent "
            "WHERE i.inhrelid = to_regclass(%s)",
            [name],
        )
        row = cursor.fetchone()
    return (row[0], bool(row[1])) if row else None


def free_name(base: str, using: str = DEFAULT_DB_ALIAS) -> str:
    """``base`` or ``base_2``, ``base_3``...: the first name no relation uses."""
    candidate, suffix = base, 1
    while relation_exists(candidate, using):
        suffix += 1
        candidate = f"{base[: 63 - len(str(suffix)) - 1]}_{suffix}"
    return candidate


def staging_tables(parent: str, using: str = DEFAULT_DB_ALIAS) -> list[tuple[str, TimeRange]]:
    """Standalone tables a drain left half-filled, found by the mark in their table comment."""
    with _cursor(using) as cursor:
        cursor.execute(
            "SELECT c.relname, obj_description(c.oid, 'pg_class') FROM pg_class c "
            "WHERE c.relkind = 'r' AND NOT c.relispartition AND obj_description(c.oid, 'pg_class') LIKE %s",
            ['{"' + STAGING_MARK + '"%'],
        )
        rows = cursor.fetchall()
    found = []
    for name, comment in rows:
        mark = json.loads(comment)
        if mark[STAGING_MARK] == parent:
            bounds = TimeRange(dt.datetime.fromisoformat(mark["start"]), dt.datetime.fromisoformat(mark["end"]))
            found.append((name, bounds))
    return found


def staging_comment(parent: str, bounds: TimeRange) -> str:
    return json.dumps({STAGING_MARK: parent, "start": bounds.start.isoformat(), "end": bounds.end.isoformat()})
