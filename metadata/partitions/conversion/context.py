"""What every phase of one table's conversion shares: the names it makes, the database, progress.

Each phase is a function of its own module (``shadow``, ``mirror``, ``copying``, ``verification``,
``swap``) taking a ``ConversionContext``; ``converter.TableConverter`` runs them in order.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import DEFAULT_DB_ALIAS, connections

from metadata.partitions.conversion.state import ConversionState, conversion_state, record_state
from metadata.partitions.errors import TableConversionError
from metadata.partitions.pacing import Pacer
from metadata.partitions.policy import PartitionPolicy

CrashPoint = Callable[[str], None]  # called with "prepared", "armed", "batch", "copied", "verified",
# "swap" (inside the swap's transaction, after the renames) and "swapped"; tests raise from it


def _no_crash(point: str) -> None:
    """The crash point of every real run: nothing happens."""


@dataclass
class ConversionContext:
    """One table's conversion: the source, its partition column, how to cut it, where to report."""

    table: str
    column: str
    policy: PartitionPolicy
    batch_rows: int
    progress: Callable[[str], None]
    using: str = DEFAULT_DB_ALIAS
    pacer: Pacer = field(default_factory=Pacer)
    crash_at: CrashPoint = _no_crash

    # The names the conversion makes, cut so that each stays within PostgreSQL's 63 bytes.
    @property
    def shadow(self) -> str:
        return f"{self.table[:51]}_partitioned"

    @property
    def old(self) -> str:
        return f"{self.table[:49]}_unpartitioned"

    @property
    def default(self) -> str:
        return f"{self.table[:55]}_default"

    @property
    def function(self) -> str:
        return f"{self.table[:40]}_conversion_mirror"

    @property
    def trigger(self) -> str:
        return self.function

    def state(self) -> ConversionState:
        state = conversion_state(self.table, self.using)
        if state is None:
            raise TableConversionError(f"no conversion of {self.table} is recorded")
        return state

    def set_state(self, **changes) -> None:
        record_state(self.table, self.using, **changes)

    def execute(self, statement: str, params: list | None = None) -> None:
        with connections[self.using].cursor() as cursor:
            cursor.execute(statement, params)

    def fetch(self, statement: str, params: list | None = None) -> list[tuple]:
        with connections[self.using].cursor() as cursor:
            cursor.execute(statement, params)
            return cursor.fetchall()
