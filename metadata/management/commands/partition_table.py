"""Turn an unpartitioned table into one RANGE-partitioned on a time column, online and resumable.

    manage.py partition_table metadata_session --column created_at [--batch-rows 5000] [--drop-old]
    manage.py partition_table metadata_session --column created_at --status

Progress goes to stdout; an interrupted run goes on from where it stopped when run again. A table
that is already partitioned is "nothing to do" (exit 0). A mistake (no such table or column, a
table that cannot be converted) is one line on stderr and exit status 1. See
``metadata.partitions.conversion`` for how writers keep writing throughout.
"""
from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS

from metadata.partitions import PartitionError, PartitionPolicy
from metadata.partitions.conversion import conversion_state, convert_to_partitioned, relkind


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class Command(BaseCommand):
    help = "Convert a table into a RANGE-partitioned one on --column, without a long lock (resumable)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("table")
        parser.add_argument("--column", required=True, help="the timestamptz column to partition on")
        parser.add_argument("--batch-rows", type=int, default=5000, help="rows copied per committed batch")
        parser.add_argument("--drop-old", action="store_true",
                            help="drop <table>_unpartitioned once swapped (kept by default)")
        parser.add_argument("--status", action="store_true", help="show the recorded conversion; change nothing")
        parser.add_argument("--database", default=DEFAULT_DB_ALIAS)

    def handle(self, *args, table: str, column: str, batch_rows: int, drop_old: bool, status: bool,
               database: str, **options) -> None:
        if batch_rows < 1:
            raise CommandError(f"partition_table: --batch-rows must be at least 1, not {batch_rows}")
        try:
            if status:
                self._status(table, database)
                return
            report = convert_to_partitioned(table, column, policy=PartitionPolicy.from_settings(),
                                            batch_rows=batch_rows, progress=self._say, using=database,
                                            drop_old=drop_old)
        except PartitionError as exc:
            raise CommandError(f"partition_table {table}: {_one_line(exc)}") from exc
        self._say(report.summary())

    def _status(self, table: str, database: str) -> None:
        kind = relkind(table, database)
        state = conversion_state(table, database)
        if kind is None and state is None:
            raise CommandError(f"partition_table {table}: no table named {table}")
        shape = {"p": "partitioned", "r": "not partitioned", None: "absent"}.get(kind, f"relkind {kind}")
        if state is None:
            self._say(f"{table}: {shape}; no conversion recorded")
            return
        key = "/".join(state.last_key) if state.last_key else "-"
        verified = (f"; verified {state.source_rows} row(s) vs {state.shadow_rows} in the shadow"
                    if state.source_rows is not None else "")
        self._say(f"{table}: {shape}; conversion on {state.partition_column} is {state.phase} "
                  f"(shadow {state.shadow_table}, old {state.old_table}); {state.rows_copied} row(s) copied, "
                  f"last key {key}{verified}; updated {state.updated_at.isoformat()}")

    def _say(self, line: str) -> None:
        self.stdout.write(line)
