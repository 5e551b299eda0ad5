"""The source table as the conversion needs to know it, read from pg_catalog, and what it refuses.

Refused, with a message: another table's (or its own) FOREIGN KEY points at the table, views
depend on it, identity or generated columns, a nullable or non-timestamptz partition column, a
unique index that lacks the partition column (a partitioned table cannot enforce it), no primary
key to copy it by.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.db import DEFAULT_DB_ALIAS, connections

from metadata.partitions.conversion.context import ConversionContext
from metadata.partitions.errors import TableConversionError
from metadata.partitions.locks import quote


@dataclass(frozen=True)
class SourceShape:
    """What the conversion needs to know about the source table, read from pg_catalog."""

    table: str
    column: str
    columns: list[str]
    types: dict[str, str]
    pk: list[str]
    pk_index: str
    indexes: dict[str, str]  # name -> CREATE INDEX statement (PK excluded)
    foreign_keys: dict[str, str]  # name -> constraint definition


def relkind(table: str, using: str = DEFAULT_DB_ALIAS) -> str | None:
    """``r`` (plain table), ``p`` (partitioned), another kind, or None when there is no such relation."""
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [quote(table, using)])
        row = cursor.fetchone()
    return row[0] if row else None


def read_shape(ctx: ConversionContext) -> SourceShape:
    """Read the source's columns, key, indexes and foreign keys; refuse what cannot be converted."""
    rows = ctx.fetch(
        "SELECT attname, format_type(atttypid, atttypmod), attnotnull, attidentity, attgenerated "
        "FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        [quote(ctx.table)])
    types = {name: kind for name, kind, _, _, _ in rows}
    if ctx.column not in types:
        raise TableConversionError(f"{ctx.table} has no column {ctx.column}")
    odd = [name for name, _, _, identity, generated in rows if identity or generated]
    if odd:
        raise TableConversionError(
            f"{ctx.table}: identity or generated columns are not supported ({', '.join(odd)})")
    if types[ctx.column] != "timestamp with time zone":
        raise TableConversionError(
            f"{ctx.table}.{ctx.column} is {types[ctx.column]}, not timestamp with time zone")
    if not next(notnull for name, _, notnull, _, _ in rows if name == ctx.column):
        raise TableConversionError(f"{ctx.table}.{ctx.column} must be NOT NULL to be a partition key")
    pk = ctx.fetch(
        "SELECT i.relname, array(SELECT a.attname FROM unnest(c.conkey) WITH ORDINALITY k(n, o) "
        "JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.n ORDER BY k.o) "
        "FROM pg_constraint c JOIN pg_class i ON i.oid = c.conindid WHERE c.conrelid = to_regclass(%s) "
        "AND c.contype = 'p'", [quote(ctx.table)])
    if not pk:
        raise TableConversionError(f"{ctx.table} has no primary key to copy it by")
    _refuse_dependents(ctx)
    return SourceShape(ctx.table, ctx.column, list(types), types, list(pk[0][1]), pk[0][0],
                       valid_indexes(ctx, ctx.table), _foreign_keys(ctx))


def _refuse_dependents(ctx: ConversionContext) -> None:
    referencing = ctx.fetch(
        "SELECT conrelid::regclass::text, conname FROM pg_constraint WHERE contype = 'f' "
        "AND confrelid = to_regclass(%s) ORDER BY 1, 2", [quote(ctx.table)])
    if referencing:
        named = ", ".join(f"{t}.{c}" for t, c in referencing)
        raise TableConversionError(f"{ctx.table} is referenced by foreign keys ({named}): drop them first")
    views = ctx.fetch(
        "SELECT DISTINCT r.ev_class::regclass::text FROM pg_depend d JOIN pg_rewrite r ON r.oid = d.objid "
        "WHERE d.classid = 'pg_rewrite'::regclass AND d.refobjid = to_regclass(%s) "
        "AND r.ev_class <> d.refobjid ORDER BY 1", [quote(ctx.table)])
    if views:
        raise TableConversionError(
            f"views depend on {ctx.table} ({', '.join(v for (v,) in views)}): drop them first")


def valid_indexes(ctx: ConversionContext, table: str) -> dict[str, str]:
    """Valid non-PK indexes of ``table``: name -> definition (``CREATE ... INDEX name ON tbl ...``)."""
    rows = ctx.fetch(
        "SELECT c.relname, pg_get_indexdef(x.indexrelid), x.indisunique, "
        "  %s = ANY(array(SELECT attname FROM pg_attribute WHERE attrelid = x.indrelid AND attnum = ANY(x.indkey))) "
        "FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid "
        "WHERE x.indrelid = to_regclass(%s) AND NOT x.indisprimary AND x.indisvalid ORDER BY c.relname",
        [ctx.column, quote(table)])
    for name, _, unique, has_column in rows:
        if unique and not has_column:
            raise TableConversionError(
                f"unique index {name} lacks {ctx.column}: a partitioned table cannot enforce it")
    return {name: definition for name, definition, _, _ in rows}


def _foreign_keys(ctx: ConversionContext) -> dict[str, str]:
    rows = ctx.fetch(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = to_regclass(%s) AND contype = 'f' ORDER BY conname", [quote(ctx.table)])
    return dict(rows)
