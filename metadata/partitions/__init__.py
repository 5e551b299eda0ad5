"""Time partitions of the growing tables: bounds, catalog, the rotation as plan + apply, upkeep.

Every table that grows with traffic is RANGE-partitioned on time with a DEFAULT partition.
``PartitionRotation`` plans one maintenance run as a ``RotationPlan`` (make partitions ahead,
drain DEFAULT into them, archive and drop expired ones through the registered ``Archiver``) and
applies it under an advisory lock; ``PartitionPolicy`` says how partitions are cut and kept.
Partitions are found by their bounds in pg_catalog (``catalog``), never by name; bounds are
half-open UTC ``TimeRange`` values (``bounds``). Errors are ``PartitionError`` and its subclasses (``errors``).

``metadata.archival`` is built on this package and never imported by it: the app registers its
``PartitionArchiver`` with ``register_archiver`` at start-up (``archiving``).

Modules: ``bounds`` (ranges, bins, the interval setting), ``catalog`` (what exists),
``policy``, ``plan`` (the plan and its report), ``lifecycle`` (the rotation), ``archiving`` (the
archiver the rotation uses), ``maker`` (make one partition, draining DEFAULT), ``ddl`` (the one
ATTACH with CHECK), ``locks`` (advisory locks, lock_timeout retries, SQL literals), ``checksum``
(a table's row checksum in SQL), ``pacing``, ``recent_index`` (the recent-activity partial
index), ``beat_jobs`` (the beat schedule), ``post_migrate`` (partitions made at ``migrate``),
``migration_operations`` (``CreatePartitionedModel``), ``conversion`` (turn a live unpartitioned
table into a partitioned one, online and resumable: ``convert_to_partitioned``; a package),
``errors``.
"""
from __future__ import annotations

from metadata.partitions import catalog
from metadata.partitions.archiving import Archiver, register_archiver
from metadata.partitions.beat_jobs import MAINTENANCE_QUEUE, PeriodicJob, periodic_jobs, register_periodic_tasks
from metadata.partitions.bounds import TimeRange, bin_start, bins, parse_interval, partition_name, uncovered
from metadata.partitions.catalog import DefaultPartitionState, PartitionInfo
from metadata.partitions.conversion import ConversionReport, convert_to_partitioned
from metadata.partitions.errors import (
    BadIntervalError,
    BoundsError,
    ConcurrentDDLInTransaction,
    LockRetriesExhausted,
    MaintenanceLockBusy,
    PartitionError,
    PartitionLookupError,
    PartitionOverlapError,
    PartitionPolicyError,
    TableConversionError,
)
from metadata.partitions.lifecycle import PartitionRotation
from metadata.partitions.locks import PARTITION_MAINTENANCE_LOCK, RECENT_INDEX_LOCK, advisory_lock
from metadata.partitions.migration_operations import CreatePartitionedModel
from metadata.partitions.pacing import Pacer
from metadata.partitions.plan import PartitionArchival, PartitionCreation, RotationPlan, RotationReport
from metadata.partitions.policy import PartitionPolicy
from metadata.partitions.recent_index import RecentIndexPolicy, existing_indexes, recent_sessions, rotate_recent_index

__all__ = [
    "MAINTENANCE_QUEUE", "PARTITION_MAINTENANCE_LOCK", "RECENT_INDEX_LOCK",
    "Archiver", "BadIntervalError", "BoundsError", "ConcurrentDDLInTransaction",
    "ConversionReport", "TableConversionError", "convert_to_partitioned",
    "CreatePartitionedModel", "DefaultPartitionState", "LockRetriesExhausted", "MaintenanceLockBusy", "Pacer",
    "PartitionArchival", "PartitionCreation", "PartitionError", "PartitionInfo", "PartitionLookupError",
    "PartitionOverlapError", "PartitionPolicy", "PartitionPolicyError", "PartitionRotation", "PeriodicJob",
    "RecentIndexPolicy", "RotationPlan", "RotationReport", "TimeRange",
    "advisory_lock", "bin_start", "bins", "catalog", "existing_indexes", "parse_interval", "partition_name",
    "periodic_jobs", "recent_sessions", "register_archiver", "register_periodic_tasks", "rotate_recent_index",
    "uncovered",
]
