"""Verification (phase ``verified``): the shadow holds exactly the source's rows.

Count and checksum of both tables are taken in ONE REPEATABLE READ snapshot. No lock is needed:
the mirror trigger keeps both tables in step in every snapshot, so any difference is a real one,
and nothing is swapped (a rerun verifies again).
"""
from __future__ import annotations

import time

from django.db import transaction

from metadata.partitions.checksum import table_checksum
from metadata.partitions.conversion.context import ConversionContext
from metadata.partitions.conversion.source import SourceShape
from metadata.partitions.errors import TableConversionError


def verify(ctx: ConversionContext, shape: SourceShape) -> None:
    """Count and checksum both tables in one REPEATABLE READ snapshot; refuse to go on if they differ."""
    started = time.perf_counter()
    with transaction.atomic(using=ctx.using):
        ctx.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        source = table_checksum(ctx.table, shape.columns, ctx.using)
        shadow = table_checksum(ctx.shadow, shape.columns, ctx.using)
    ctx.set_state(source_rows=source[0], source_checksum=source[1], shadow_rows=shadow[0],
                  shadow_checksum=shadow[1])
    if source != shadow:
        raise TableConversionError(
            f"{ctx.shadow} does not match {ctx.table}: {shadow[0]} rows, checksum {shadow[1][:12]} vs "
            f"{source[0]} rows, {source[1][:12]}; nothing swapped (rerun to verify again)")
    ctx.set_state(phase="verified")
    ctx.progress(f"{ctx.table}: verified {source[0]} row(s), checksum {source[1][:12]}, "
                 f"in {time.perf_counter() - started:.1f} s")
    ctx.crash_at("verified")
