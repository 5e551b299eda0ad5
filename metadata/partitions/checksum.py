"""A table's row count and row checksum, computed in SQL, the same in every session.

Each row's text is hashed under fixed output settings (``CANONICAL_SETTINGS``), so the same rows
give the same checksum whichever session reads them and in whatever order: the conversion
compares a table with its partitioned copy by it, and archival compares a partition with its
archive re-imported into a scratch table.
"""
from __future__ import annotations

import hashlib

from django.db import DEFAULT_DB_ALIAS, connections

from metadata.partitions.locks import quote

# Output settings that make a row's text (hence its hash) the same in every session.
CANONICAL_SETTINGS = (
    "SET LOCAL TimeZone = 'UTC'",
    "SET LOCAL DateStyle = 'ISO, YMD'",
    "SET LOCAL IntervalStyle = 'postgres'",
    "SET LOCAL extra_float_digits = 1",
    "SET LOCAL bytea_output = 'hex'",
)


def set_canonical_output(cursor) -> None:
    """Fix the output settings for the rest of the transaction (``COPY`` text and row hashes)."""
    for statement in CANONICAL_SETTINGS:
        cursor.execute(statement)


def table_checksum(table: str, columns: list[str], using: str = DEFAULT_DB_ALIAS) -> tuple[int, str]:
    """(row count, checksum) of ``table`` over ``columns``; call inside a transaction.

    Each row's text is hashed with md5 and the two 64-bit halves are summed exactly (numeric),
    so the result needs no sort and no memory, and any changed, missing or extra row shows.
    """
    row = ", ".join(quote(c, using) for c in columns)
    with connections[using].cursor() as cursor:
        set_canonical_output(cursor)
        cursor.execute(
            "SELECT count(*), "
            "coalesce(sum(('x' || substr(h, 1, 16))::bit(64)::bigint::numeric), 0)::text, "
            "coalesce(sum(('x' || substr(h, 17, 16))::bit(64)::bigint::numeric), 0)::text "
            f"FROM (SELECT md5(ROW({row})::text) AS h FROM {quote(table, using)}) hashed"
        )
        count, high, low = cursor.fetchone()
    return count, hashlib.sha256(f"{count}:{high}:{low}".encode()).hexdigest()
