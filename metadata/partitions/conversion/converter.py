"""One table's conversion from start to end: each phase in turn, from wherever a crash left it.

``TableConverter.run`` reads the recorded phase (``state``) and runs the phases still to do,
each from its own module: ``shadow.prepare``, ``mirror.arm``, ``copying.copy_rows``,
``shadow.sync_indexes`` and ``verification.verify``, ``swap.swap``, and ``swap.drop_old`` when
asked. One conversion runs at a time (an advisory lock).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import DEFAULT_DB_ALIAS, connections

from metadata.partitions import catalog
from metadata.partitions.conversion.context import ConversionContext, CrashPoint
from metadata.partitions.conversion.copying import copy_rows
from metadata.partitions.conversion.mirror import arm
from metadata.partitions.conversion.shadow import check_names_free, prepare, sync_indexes
from metadata.partitions.conversion.source import SourceShape, read_shape, relkind
from metadata.partitions.conversion.state import STATE_DDL, STATE_TABLE, conversion_state
from metadata.partitions.conversion.swap import IndexesChanged, drop_old, swap
from metadata.partitions.conversion.verification import verify
from metadata.partitions.errors import TableConversionError
from metadata.partitions.locks import advisory_lock, quote
from metadata.partitions.pacing import Pacer
from metadata.partitions.policy import PartitionPolicy

logger = logging.getLogger(__name__)

TABLE_CONVERSION_LOCK = 0x5350_4543_0003  # "SPEC" + 3: one conversion at a time (partitions are 1 and 2)
SWAP_ATTEMPTS = 3  # indexes changed on the source between their sync and the swap's lock: sync again


@dataclass
class ConversionReport:
    """What one ``convert_to_partitioned`` call did, for the command's output."""

    table: str
    column: str
    phase: str
    nothing_to_do: bool = False
    rows_copied: int = 0
    partitions: list[str] = field(default_factory=list)
    rows: int | None = None
    checksum: str | None = None
    old_table: str | None = None
    seconds: float = 0.0

    def summary(self) -> str:
        if self.nothing_to_do:
            return f"{self.table} is already partitioned: nothing to do"
        kept = f", old rows kept in {self.old_table}" if self.old_table else ""
        return (f"{self.table}: {self.phase}; {self.rows} row(s) verified (checksum {str(self.checksum)[:12]}), "
                f"{self.rows_copied} copied in batches in {self.seconds:.1f} s{kept}")


def convert_to_partitioned(table: str, column: str, *, policy: PartitionPolicy | None = None,
                           batch_rows: int = 5000, progress: Callable[[str], None] | None = None,
                           using: str = DEFAULT_DB_ALIAS, drop_old: bool = False,
                           pacer: Pacer | None = None, crash_at: CrashPoint | None = None) -> ConversionReport:
    """Convert ``table`` into a table RANGE-partitioned on ``column`` (see ``metadata.partitions.conversion``).

    Idempotent: a partitioned ``table`` is a no-op (``nothing_to_do``), an interrupted run resumes.
    Call outside a transaction (in a migration: ``RunPython(..., atomic=False)``).
    """
    converter = TableConverter(table, column, policy=policy or PartitionPolicy.from_settings(),
                               batch_rows=batch_rows, progress=progress or logger.info, using=using,
                               pacer=pacer, crash_at=crash_at)
    return converter.run(drop_old=drop_old)


class TableConverter:
    """One table's conversion: each phase a function of its module, each safe to rerun after a crash."""

    def __init__(self, table: str, column: str, policy: PartitionPolicy, batch_rows: int,
                 progress: Callable[[str], None], using: str = DEFAULT_DB_ALIAS,
                 pacer: Pacer | None = None, crash_at: CrashPoint | None = None) -> None:
        if batch_rows < 1:
            raise TableConversionError("batch_rows must be at least 1")
        self.context = ConversionContext(table, column, policy, batch_rows, progress, using,
                                         pacer or Pacer(), crash_at or (lambda point: None))
        self.partitions: list[str] = []

    def run(self, drop_old: bool = False) -> ConversionReport:
        ctx = self.context
        started = time.perf_counter()
        if connections[ctx.using].in_atomic_block:
            raise TableConversionError("convert_to_partitioned commits in batches: call it outside a transaction")
        kind = relkind(ctx.table, ctx.using)
        if kind is None:
            raise TableConversionError(f"no table named {ctx.table}")
        if ctx.column not in catalog.table_columns(quote(ctx.table), ctx.using):
            raise TableConversionError(f"{ctx.table} has no column {ctx.column}")
        if kind == "p":
            return self._finish(drop_old, started, converted=False)
        if kind != "r":
            raise TableConversionError(f"{ctx.table} is not a plain table (relkind {kind!r})")
        shape = read_shape(ctx)
        with advisory_lock(TABLE_CONVERSION_LOCK, ctx.using):
            ctx.execute(STATE_DDL)
            self._convert(shape)
        return self._finish(drop_old, started, converted=True)

    def _convert(self, shape: SourceShape) -> None:
        ctx = self.context
        state = conversion_state(ctx.table, ctx.using)
        if state is not None and state.phase in ("swapped", "dropped"):  # a new table of the same name
            ctx.execute(f"DELETE FROM {STATE_TABLE} WHERE source_table = %s", [ctx.table])
            state = None
        if state is None:
            check_names_free(ctx)
            self.partitions = prepare(ctx, shape)
            state = ctx.state()
        if state.phase == "prepared":
            arm(ctx, shape)
            state = ctx.state()
        if state.phase in ("armed", "copying"):
            copy_rows(ctx, shape, state)
            state = ctx.state()
        for _ in range(SWAP_ATTEMPTS):
            if state.phase == "copied":
                sync_indexes(ctx, shape, state)
                verify(ctx, shape)
                state = ctx.state()
            try:
                swap(ctx, shape, state)
                return
            except IndexesChanged:
                ctx.set_state(phase="copied")
                state = ctx.state()
        raise TableConversionError(f"the indexes of {ctx.table} keep changing: rerun later")

    def _finish(self, drop_old_table: bool, started: float, converted: bool) -> ConversionReport:
        ctx = self.context
        state = conversion_state(ctx.table, ctx.using)
        dropped = False
        if drop_old_table and state is not None and state.phase == "swapped":
            drop_old(ctx, state)
            state, dropped = ctx.state(), True
        if state is None or not (converted or dropped):
            return ConversionReport(ctx.table, ctx.column, state.phase if state else "partitioned",
                                    nothing_to_do=True, seconds=time.perf_counter() - started)
        return ConversionReport(
            ctx.table, ctx.column, state.phase, rows_copied=state.rows_copied, partitions=self.partitions,
            rows=state.source_rows, checksum=state.source_checksum,
            old_table=state.old_table if state.phase == "swapped" else None, seconds=time.perf_counter() - started)
