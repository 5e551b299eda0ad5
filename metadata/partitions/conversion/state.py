"""The conversion's record: one row per table in ``metadata_table_conversion``, made by the tool.

The row says which phase a table's conversion has completed, so a rerun goes on from there; the
copy's cursor (``last_key``, ``rows_copied``) is committed with each batch.
"""
from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass

from django.db import DEFAULT_DB_ALIAS, connections

from metadata.partitions import catalog

STATE_TABLE = "metadata_table_conversion"
PHASES = ("prepared", "armed", "copying", "copied", "verified", "swapped", "dropped")
JSON_FIELDS = ("index_names", "copy_until", "last_key")

STATE_DDL = f"""
CREATE TABLE IF NOT EXISTS {STATE_TABLE} (
    source_table text PRIMARY KEY,
    partition_column text NOT NULL,
    shadow_table text NOT NULL,
    old_table text NOT NULL,
    phase text NOT NULL,
    index_names jsonb NOT NULL DEFAULT '{{}}',
    copy_until jsonb,
    last_key jsonb,
    rows_copied bigint NOT NULL DEFAULT 0,
    source_rows bigint,
    source_checksum text,
    shadow_rows bigint,
    shadow_checksum text,
    started_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
)"""


@dataclass
class ConversionState:
    """One row of ``metadata_table_conversion``."""

    source_table: str
    partition_column: str
    shadow_table: str
    old_table: str
    phase: str
    index_names: dict[str, str]  # shadow index -> the source's name it takes at the swap
    copy_until: list[str] | None
    last_key: list[str] | None
    rows_copied: int
    source_rows: int | None
    source_checksum: str | None
    shadow_rows: int | None
    shadow_checksum: str | None
    started_at: dt.datetime
    updated_at: dt.datetime


def conversion_state(table: str, using: str = DEFAULT_DB_ALIAS) -> ConversionState | None:
    """The recorded conversion of ``table`` (None if none was ever started)."""
    if not catalog.relation_exists(STATE_TABLE, using):
        return None
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT * FROM {STATE_TABLE} WHERE source_table = %s", [table])
        row = cursor.fetchone()
        if row is None:
            return None
        names = [d[0] for d in cursor.description]
    values = dict(zip(names, row, strict=True))
    for key in JSON_FIELDS:
        if isinstance(values[key], str):
            values[key] = json.loads(values[key])
    return ConversionState(**values)


def record_state(table: str, using: str = DEFAULT_DB_ALIAS, **changes) -> None:
    """Update ``table``'s row (the JSON fields given already encoded, as ``json.dumps`` text)."""
    assignments = ", ".join(f"{name} = %s::jsonb" if name in JSON_FIELDS else f"{name} = %s" for name in changes)
    with connections[using].cursor() as cursor:
        cursor.execute(f"UPDATE {STATE_TABLE} SET {assignments}, updated_at = now() WHERE source_table = %s",
                       [*changes.values(), table])
