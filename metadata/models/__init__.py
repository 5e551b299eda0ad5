"""The metadata store: tenants, model versions, sessions, and their partitioned history tables.

One module per concern: ``tenants``, ``model_versions`` (the model registry's rows), ``sessions``,
``history`` (tokens and candidates),
``request_log``, ``statements`` (pg_stat_statements snapshots and baselines), ``partitioned``
(which tables are partitioned, on which column), ``archival``, ``cache_stats``, ``maintenance``.
Every model is importable from here (``from metadata.models import Session``), which is also how
Django finds them. The operators' rollups are the ``ops`` app's (``ops.models.OpsRollup``).

Sessions, token history, candidates, the request log and the statement snapshots are
RANGE-partitioned on a time column; every primary key in those tables includes it (PostgreSQL
requires it). A session's id is a UUIDv7 of its ``created_at`` (``metadata.ids``), so a lookup
by id reads one partition (``metadata.session_keys``).
"""
from __future__ import annotations

from metadata.models.archival import ArchivalStep, PartitionArchivalJob
from metadata.models.cache_stats import CacheStatsSnapshot
from metadata.models.history import Candidate, TokenKind, TokenRecord
from metadata.models.maintenance import MaintenanceAction, MaintenanceRun, MaintenanceRunStatus
from metadata.models.model_versions import (
    LoadDtype,
    ModelRole,
    ModelVersion,
    VariantKind,
    VersionStatus,
    model_promoted,
)
from metadata.models.partitioned import PARTITIONED_TABLES
from metadata.models.request_log import RequestLog
from metadata.models.sessions import LIVE_STATUSES, Session, SessionStatus
from metadata.models.statements import StatementBaseline, StatementSnapshot
from metadata.models.tenants import Tenant, TenantMembership

__all__ = [
    "LIVE_STATUSES", "PARTITIONED_TABLES",
    "ArchivalStep", "CacheStatsSnapshot", "Candidate", "LoadDtype", "MaintenanceAction", "MaintenanceRun",
    "MaintenanceRunStatus", "ModelRole", "ModelVersion", "PartitionArchivalJob", "RequestLog", "Session",
    "SessionStatus", "StatementBaseline", "StatementSnapshot", "Tenant", "TenantMembership", "TokenKind",
    "TokenRecord", "VariantKind", "VersionStatus", "model_promoted",
]
