"""Which tables are RANGE-partitioned, and on which column.

Created by ``metadata.partitions.migration_operations.CreatePartitionedModel`` (the sessions
table was converted in place by ``metadata.partitions.conversion``); every primary key in them
includes that column, as PostgreSQL requires.
"""
from __future__ import annotations

from metadata.models.history import Candidate, TokenRecord
from metadata.models.request_log import RequestLog
from metadata.models.sessions import Session
from metadata.models.statements import StatementSnapshot

# table -> RANGE partition column, for the migrations and the partition lifecycle.
PARTITIONED_TABLES: dict[str, str] = {
    Session._meta.db_table: "created_at",
    TokenRecord._meta.db_table: "session_created_at",
    Candidate._meta.db_table: "session_created_at",
    RequestLog._meta.db_table: "requested_at",
    StatementSnapshot._meta.db_table: "taken_at",
}
