"""The swap (phase ``swapped``) and the drop of the old table (``dropped``).

One transaction under ``lock_timeout`` (retried): ACCESS EXCLUSIVE on both tables, drop the
mirror trigger, source -> ``<table>_unpartitioned``, shadow -> ``<table>``, and the shadow's PK and
indexes take the source's names (so Django's migration state still matches). Writers queue behind
the lock for milliseconds; a statement that waited re-reads the name after the lock, so it writes
to the new table without an error. Should the source's indexes have changed since the shadow's
were made to match, the swap gives up (``IndexesChanged``) and the converter syncs them again.
"""
from __future__ import annotations

from metadata.partitions import catalog
from metadata.partitions.conversion.context import ConversionContext
from metadata.partitions.conversion.mirror import disarm
from metadata.partitions.conversion.source import SourceShape, valid_indexes
from metadata.partitions.conversion.state import ConversionState
from metadata.partitions.locks import quote, with_lock_retries


class IndexesChanged(Exception):
    """The source's indexes changed after the shadow's were made to match (the converter retries)."""


def swap(ctx: ConversionContext, shape: SourceShape, state: ConversionState) -> None:
    """Lock both, drop the trigger, rename tables and indexes: one short transaction, retried."""
    mirrored = {original for original in state.index_names.values() if original != shape.pk_index}

    def rename() -> None:
        ctx.execute(f"LOCK TABLE {quote(ctx.table)}, {quote(ctx.shadow)} IN ACCESS EXCLUSIVE MODE")
        if set(valid_indexes(ctx, ctx.table)) != mirrored:
            raise IndexesChanged()
        disarm(ctx)
        for original in sorted(state.index_names.values()):
            if catalog.relation_exists(original, ctx.using):
                ctx.execute(f"ALTER INDEX {quote(original)} RENAME TO "
                            f"{quote(catalog.free_name(f'{original[:49]}_unpartitioned', ctx.using))}")
        ctx.execute(f"ALTER TABLE {quote(ctx.table)} RENAME TO {quote(ctx.old)}")
        ctx.execute(f"ALTER TABLE {quote(ctx.shadow)} RENAME TO {quote(ctx.table)}")
        for temporary, original in sorted(state.index_names.items()):
            ctx.execute(f"ALTER INDEX {quote(temporary)} RENAME TO {quote(original)}")
        _move_sequences(ctx)
        ctx.set_state(phase="swapped")
        ctx.crash_at("swap")

    with_lock_retries(rename, f"swap {ctx.table} and {ctx.shadow}", ctx.using)
    ctx.progress(f"{ctx.table}: swapped; the partitioned table is {ctx.table}, the old one {ctx.old}")
    ctx.crash_at("swapped")


def _move_sequences(ctx: ConversionContext) -> None:
    """Sequences owned by the old table's columns (serial) now belong to the new table's."""
    owned = ctx.fetch(
        "SELECT d.objid::regclass::text, a.attname FROM pg_depend d JOIN pg_class s ON s.oid = d.objid "
        "JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid "
        "WHERE d.refobjid = to_regclass(%s) AND s.relkind = 'S' AND d.deptype = 'a'", [quote(ctx.old)])
    for sequence, column in owned:
        ctx.execute(f"ALTER SEQUENCE {sequence} OWNED BY {quote(ctx.table)}.{quote(column)}")


def drop_old(ctx: ConversionContext, state: ConversionState) -> None:
    """Drop ``<table>_unpartitioned`` once the swap is done (``drop_old``); retried on lock timeouts."""
    def drop() -> None:
        ctx.execute(f"DROP TABLE IF EXISTS {quote(state.old_table)}")
        ctx.set_state(phase="dropped")

    with_lock_retries(drop, f"drop {state.old_table}", ctx.using)
    ctx.progress(f"{ctx.table}: dropped {state.old_table}")
