"""Make one RANGE partition of a parent table, draining the DEFAULT partition's rows into it.

A partition is made as a standalone table ``LIKE`` the parent with a CHECK on its bounds
(``metadata.partitions.ddl``), filled with the DEFAULT partition's rows of its range in committed
batches, given the parent's indexes (built on the standalone table, blocking no one), then
attached in one short transaction under ``lock_timeout`` (retried) that takes SHARE
on the parent, locks DEFAULT and moves the last stragglers (so ATTACH never meets a row it would
refuse), and ATTACHes.

A half-drained table is marked in its table comment and finished by the next run. Rows being
moved sit in the not-yet-attached table while the drain runs: not lost, but not visible through
the parent until the ATTACH. Long work is paced (``metadata.partitions.pacing``) to leave writers CPU.
"""
from __future__ import annotations

from collections.abc import Callable

from django.db import DEFAULT_DB_ALIAS, connections, transaction

from metadata.partitions import catalog
from metadata.partitions.bounds import TimeRange, partition_name, uncovered
from metadata.partitions.ddl import attach_checked_table, build_parent_indexes, create_checked_table
from metadata.partitions.locks import literal, quote, with_lock_retries
from metadata.partitions.pacing import Pacer
from metadata.partitions.policy import PartitionPolicy


class PartitionMaker:
    """Make the RANGE partitions of one parent table, draining DEFAULT rows into them."""

    def __init__(self, parent: str, column: str, policy: PartitionPolicy, progress: Callable[[str], None],
                 using: str = DEFAULT_DB_ALIAS, pacer: Pacer | None = None) -> None:
        self.parent, self.column, self.policy, self.progress, self.using = parent, column, policy, progress, using
        self.pacer = pacer or Pacer()

    def make(self, bounds: TimeRange) -> tuple[list[str], int]:
        """Make the parts of ``bounds`` no partition covers now (all of it, unless a run since the
        plan made some); (names made, rows moved from DEFAULT)."""
        existing = [p.bounds for p in catalog.range_partitions(self.parent, self.using)]
        existing += [b for _, b in catalog.staging_tables(self.parent, self.using)]
        made, moved = [], 0
        for gap in uncovered(bounds, existing):
            name = self._create_staging(gap)
            moved += self._fill_and_attach(name, gap)
            made.append(name)
            self.pacer.pause()
        return made, moved

    def finish(self, name: str, bounds: TimeRange) -> tuple[list[str], int]:
        """Fill and attach the half-drained table ``name``, if it still is one; (names, rows moved)."""
        if (name, bounds) not in catalog.staging_tables(self.parent, self.using):
            return [], 0
        return [name], self._fill_and_attach(name, bounds)

    def _create_staging(self, bounds: TimeRange) -> str:
        name = catalog.free_name(partition_name(self.parent, bounds), self.using)
        with transaction.atomic(using=self.using):
            create_checked_table(self.parent, name, self.column, bounds,
                                 comment=catalog.staging_comment(self.parent, bounds), using=self.using)
        return name

    def _move_sql(self, default: str, target: str, bounds: TimeRange, limit: int | None) -> str:
        columns = ", ".join(quote(c) for c in catalog.table_columns(self.parent, self.using))
        col = quote(self.column)
        where = f"{col} >= {literal(bounds.start)} AND {col} < {literal(bounds.end)}"
        if limit is None:
            picked = f"DELETE FROM {quote(default)} WHERE {where}"
        else:
            picked = (f"DELETE FROM {quote(default)} WHERE ctid = ANY(ARRAY("
                      f"SELECT ctid FROM {quote(default)} WHERE {where} LIMIT {int(limit)} FOR UPDATE SKIP LOCKED))")
        return (f"WITH moved AS ({picked} RETURNING {columns}) "
                f"INSERT INTO {quote(target)} ({columns}) SELECT {columns} FROM moved")

    def _drain(self, default: str, name: str, bounds: TimeRange) -> int:
        """Move DEFAULT's rows of ``bounds`` into ``name`` in committed, paced batches."""
        moved = 0
        batch = self._move_sql(default, name, bounds, self.policy.drain_batch_rows)
        while True:
            with transaction.atomic(using=self.using), connections[self.using].cursor() as cursor:
                cursor.execute(batch)
                count = cursor.rowcount
            moved += count
            self.pacer.pause()
            if count:
                self.progress(f"{self.parent}: moved {moved} row(s) from {default} into {name}")
            if count < self.policy.drain_batch_rows:
                return moved

    def _fill_and_attach(self, name: str, bounds: TimeRange) -> int:
        default = catalog.default_partition(self.parent, self.using)
        moved = self._drain(default.name, name, bounds) if default is not None else 0
        with transaction.atomic(using=self.using):
            build_parent_indexes(self.parent, name, self.using)  # before the ATTACH, not under its lock

        def move_stragglers(cursor) -> int:
            if default is None:
                return 0
            cursor.execute(f"LOCK TABLE {quote(default.name)} IN ACCESS EXCLUSIVE MODE")
            cursor.execute(self._move_sql(default.name, name, bounds, None))
            return cursor.rowcount

        def attach() -> int:
            stragglers = attach_checked_table(self.parent, name, bounds, self.using, before_attach=move_stragglers)
            with connections[self.using].cursor() as cursor:
                cursor.execute(f"COMMENT ON TABLE {quote(name)} IS NULL")
            return stragglers

        moved += with_lock_retries(attach, f"attach {name}", self.using)
        self.progress(f"{self.parent}: attached {name} {bounds}")
        return moved
