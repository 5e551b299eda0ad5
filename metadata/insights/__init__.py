"""Database insights: hot queries from pg_stat_statements, a latency heatmap, the capacity plan.

A beat job (``snapshot_statements``, task ``metadata.insights.snapshot_statements``, every
``SPECOPS_INSIGHTS_SNAPSHOT_MINUTES``) stores per-interval deltas of pg_stat_statements for the
primary and each replica in the partitioned ``StatementSnapshot`` table (``statement_snapshots``). From
those rows: the top statements of a window (``hot_queries``), each statement's normalised text,
family and the code that sent it (``statements``; the SQL tag comes from ``tagging``), the
hour x family latency heatmap (``heatmap``), sequential scans of big tables in generic plans
(``explain``), and the capacity plan with its buffer (``capacity``, on the inputs of ``load``).

Modules: ``statements``, ``tagging``, ``statement_snapshots``, ``hot_queries``, ``explain``, ``heatmap``,
``load``, ``capacity``, ``window``, ``beat`` (the schedule entry), ``tasks``, ``admin`` (the two
admin pages, imported by ``metadata/admin.py``).
"""
from __future__ import annotations

from metadata.insights.beat import SNAPSHOT_JOB, SNAPSHOT_TASK, register_snapshot_job
from metadata.insights.capacity import CapacityPlan, Needs, PoolNeed, capacity_plan, render_lines
from metadata.insights.explain import PlanCheck, SequentialScan, sequential_scans
from metadata.insights.heatmap import Heatmap, heatmap_svg, latency_heatmap
from metadata.insights.hot_queries import ORDERS, DatabaseStatements, HotQuery, hot_queries, with_plans
from metadata.insights.load import DatabaseLoad, Rate, Storage, TableGrowth
from metadata.insights.statement_snapshots import (
    SNAPSHOT_LOCK,
    SnapshotReport,
    StatementSnapshotter,
    StatementsUnavailable,
    read_counters,
    take_snapshot,
)
from metadata.insights.statements import StatementText, describe, family_of, normalise
from metadata.insights.tagging import SqlTagMiddleware, current_tag, sql_tag
from metadata.insights.tasks import snapshot_statements
from metadata.insights.window import WINDOW_CHOICES_HOURS, Window

__all__ = [
    "ORDERS", "SNAPSHOT_JOB", "SNAPSHOT_LOCK", "SNAPSHOT_TASK", "WINDOW_CHOICES_HOURS",
    "CapacityPlan", "DatabaseLoad", "DatabaseStatements", "Heatmap", "HotQuery", "Needs", "PlanCheck", "PoolNeed",
    "Rate", "SequentialScan", "SnapshotReport", "SqlTagMiddleware", "StatementSnapshotter", "StatementText",
    "StatementsUnavailable", "Storage", "TableGrowth", "Window",
    "capacity_plan", "current_tag", "describe", "family_of", "heatmap_svg", "hot_queries", "latency_heatmap",
    "normalise", "read_counters", "register_snapshot_job", "render_lines", "sequential_scans", "snapshot_statements",
    "sql_tag", "take_snapshot", "with_plans",
]
