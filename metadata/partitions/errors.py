"""Errors of partition maintenance: one base, so callers catch one thing.

``metadata.archival`` derives its own errors from ``PartitionError`` (``metadata.archival.errors``:
``ArchivalError``, ``ArchiveIntegrityError``), so the ``partitions`` command and the beat job
handle archival's failures like every other maintenance failure::

    PartitionError                      anything partition maintenance refuses or cannot do
    ├── PartitionPolicyError            the SPECOPS_PARTITION_* settings (also ImproperlyConfigured)
    │   └── BadIntervalError            the interval cannot be aligned on UTC
    ├── BoundsError                     a naive datetime or an empty range (also ValueError)
    ├── PartitionLookupError            a named table is not a partition maintenance may touch
    ├── PartitionOverlapError           a range that an attached partition already covers
    ├── MaintenanceLockBusy             another run holds the advisory lock; this one did nothing
    ├── LockRetriesExhausted            no lock within lock_timeout after every retry
    ├── ConcurrentDDLInTransaction      a ``... CONCURRENTLY`` statement called inside a transaction
    ├── TableConversionError            a table cannot be converted as it is, or its copy differs
    └── ArchivalError                   archiving or restoring one partition (metadata.archival.errors)
        └── ArchiveIntegrityError       an archive is damaged or does not match what was recorded
"""
from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured


class PartitionError(Exception):
    """Base of every error partition maintenance (and archival, above it) raises on purpose."""


class PartitionPolicyError(PartitionError, ImproperlyConfigured):
    """A SPECOPS_PARTITION_* setting is unusable (system checks report it at start-up)."""


class BadIntervalError(PartitionPolicyError):
    """The configured partition interval is not one the bounds can align on UTC."""


class BoundsError(PartitionError, ValueError):
    """A bound that is not a UTC instant (naive datetime) or a range that is empty."""


class PartitionLookupError(PartitionError):
    """The named table is absent, belongs to an unmanaged table, or is a DEFAULT partition."""


class PartitionOverlapError(PartitionError):
    """An attached partition already covers part of the range."""


class MaintenanceLockBusy(PartitionError):
    """Another maintenance run holds the advisory lock; this run did nothing."""


class LockRetriesExhausted(PartitionError):
    """A statement could not get its lock within ``lock_timeout`` after every retry."""


class ConcurrentDDLInTransaction(PartitionError):
    """``... CONCURRENTLY`` refuses a transaction block, and the caller is inside one."""


class TableConversionError(PartitionError):
    """The table cannot be converted as it is, or the copy does not match the source."""
