"""The partitioned shadow ``<table>_partitioned``: made once (phase ``prepared``), its indexes kept in step.

The shadow is ``LIKE`` the source (defaults, CHECKs, NOT NULLs), ``PARTITION BY RANGE (column)``,
its primary key the source's plus the column, with a DEFAULT partition ``<table>_default``, a
partition per bin holding rows plus the current bin and ``premake`` ahead (named by
``bounds.partition_name``, so the rotation manages them later), every other index of the source
(``pg_get_indexdef``, under a temporary name it swaps for the source's at the end) and its
FOREIGN KEYs. Indexes added to the source during the copy are built on the shadow (per partition,
concurrently, attached ``ON ONLY``) before verification; indexes dropped from it are dropped from
the shadow.
"""
from __future__ import annotations

import json
import re

from django.utils import timezone

from metadata.partitions import catalog
from metadata.partitions.bounds import BIN_ORIGIN, TimeRange, bin_start, bins, partition_name
from metadata.partitions.conversion.context import ConversionContext
from metadata.partitions.conversion.source import SourceShape, valid_indexes
from metadata.partitions.conversion.state import STATE_TABLE, ConversionState
from metadata.partitions.errors import TableConversionError
from metadata.partitions.locks import autocommit_with_lock_retries, literal, quote, with_lock_retries


def check_names_free(ctx: ConversionContext) -> None:
    """Refuse to start over tables of the names the conversion makes (a leftover, someone's own)."""
    for name in (ctx.shadow, ctx.old, ctx.default):
        if catalog.relation_exists(name, ctx.using):
            raise TableConversionError(f"{name} already exists: rename or drop it before converting {ctx.table}")


def prepare(ctx: ConversionContext, shape: SourceShape) -> list[str]:
    """Make the shadow with its partitions, indexes and FKs, and the state row, in one transaction;
    the names of the range partitions made."""
    col = quote(ctx.column)
    wanted = _bins(ctx)
    partitions: list[str] = []

    def make() -> None:
        partitions.clear()
        ctx.execute(f"CREATE TABLE {quote(ctx.shadow)} (LIKE {quote(ctx.table)} INCLUDING DEFAULTS "
                    f"INCLUDING CONSTRAINTS) PARTITION BY RANGE ({col})")
        key = shape.pk + ([] if ctx.column in shape.pk else [ctx.column])
        names = {temporary_name(ctx, shape.pk_index): shape.pk_index}
        pk_name = next(iter(names))
        ctx.execute(f"ALTER TABLE {quote(ctx.shadow)} ADD CONSTRAINT {quote(pk_name)} "
                    f"PRIMARY KEY ({', '.join(quote(c) for c in key)})")
        ctx.execute(f"CREATE TABLE {quote(ctx.default)} PARTITION OF {quote(ctx.shadow)} DEFAULT")
        for bounds in wanted:
            name = catalog.free_name(partition_name(ctx.table, bounds), ctx.using)
            ctx.execute(f"CREATE TABLE {quote(name)} PARTITION OF {quote(ctx.shadow)} "
                        f"FOR VALUES FROM ({literal(bounds.start)}) TO ({literal(bounds.end)})")
            partitions.append(name)
        for name, definition in shape.indexes.items():
            temporary = temporary_name(ctx, name)
            ctx.execute(retarget(ctx, definition, name, temporary, ctx.table, ctx.shadow))
            names[temporary] = name
        for name, definition in shape.foreign_keys.items():
            ctx.execute(f"ALTER TABLE {quote(ctx.shadow)} ADD CONSTRAINT {quote(name)} {definition}")
        ctx.execute(
            f"INSERT INTO {STATE_TABLE} (source_table, partition_column, shadow_table, old_table, phase, "
            f"index_names) VALUES (%s, %s, %s, %s, 'prepared', %s)",
            [ctx.table, ctx.column, ctx.shadow, ctx.old, json.dumps(names)])

    with_lock_retries(make, f"prepare {ctx.shadow}", ctx.using)
    ctx.progress(f"{ctx.table}: made {ctx.shadow} with {len(partitions)} partition(s) and "
                 f"{ctx.default}, {len(shape.indexes)} index(es), {len(shape.foreign_keys)} foreign key(s)")
    ctx.crash_at("prepared")
    return partitions


def _bins(ctx: ConversionContext) -> list[TimeRange]:
    """The bins holding rows now, the current bin and ``premake`` bins ahead."""
    width = ctx.policy.interval
    rows = ctx.fetch(f"SELECT DISTINCT date_bin(%s, {quote(ctx.column)}, %s) FROM {quote(ctx.table)}",
                     [width, BIN_ORIGIN])
    wanted = {TimeRange(start, start + width) for (start,) in rows}
    current = bin_start(timezone.now(), width)
    wanted.update(bins(current, current + width * (ctx.policy.premake + 1), width))
    return sorted(wanted)


def temporary_name(ctx: ConversionContext, name: str) -> str:
    """A free name for the shadow's copy of index ``name`` until the swap gives it ``name``."""
    return catalog.free_name(f"{name[:56]}_shadow", ctx.using)


def retarget(ctx: ConversionContext, definition: str, name: str, new_name: str, table: str, new_table: str) -> str:
    """``CREATE INDEX name ON public.table USING ...`` -> the same on ``new_table`` as ``new_name``."""
    qualified = ctx.fetch("SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) FROM pg_class c "
                          "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass(%s)",
                          [quote(table)])[0][0]
    pattern = (r"^CREATE (UNIQUE )?INDEX " + re.escape(ctx.fetch("SELECT quote_ident(%s)", [name])[0][0])
               + r" ON (ONLY )?" + re.escape(qualified) + r" USING ")
    match = re.match(pattern, definition)
    if not match:
        raise TableConversionError(f"cannot read the definition of index {name}: {definition}")
    head = f"CREATE {match.group(1) or ''}INDEX {quote(new_name)} ON {quote(new_table)} USING "
    return head + definition[match.end():]


def sync_indexes(ctx: ConversionContext, shape: SourceShape, state: ConversionState) -> None:
    """Follow index changes made to the source since preparation (a rebuilt partial index, say)."""
    wanted = valid_indexes(ctx, ctx.table)
    have = {original: temporary for temporary, original in state.index_names.items()
            if original != shape.pk_index}
    for original in sorted(set(have) - set(wanted)):
        ctx.execute(f"DROP INDEX IF EXISTS {quote(have[original])}")
        del state.index_names[have[original]]
    for original in sorted(set(wanted) - set(have)):
        temporary = temporary_name(ctx, original)
        _build_on_partitions(ctx, retarget(ctx, wanted[original], original, temporary, ctx.table, ctx.shadow),
                             temporary)
        state.index_names[temporary] = original
    if set(wanted) != set(have):
        ctx.set_state(index_names=json.dumps(state.index_names))
        ctx.progress(f"{ctx.table}: indexes of {ctx.shadow} follow the source's ({len(wanted)})")


def _build_on_partitions(ctx: ConversionContext, definition: str, name: str) -> None:
    """A parent index ``ON ONLY`` the shadow, each partition's built concurrently and attached."""
    on_only = definition.replace(f" ON {quote(ctx.shadow)} USING ", f" ON ONLY {quote(ctx.shadow)} USING ", 1)
    ctx.execute(on_only)
    for n, partition in enumerate(catalog.list_partitions(ctx.shadow, ctx.using)):
        part_index = catalog.free_name(f"{name[:54]}_p{n}", ctx.using)
        statement = definition.replace(f"INDEX {quote(name)} ON {quote(ctx.shadow)} USING ",
                                       f"INDEX CONCURRENTLY {quote(part_index)} ON {quote(partition.name)} USING ", 1)
        autocommit_with_lock_retries(statement, f"build {part_index}", ctx.using)
        ctx.execute(f"ALTER INDEX {quote(name)} ATTACH PARTITION {quote(part_index)}")
