"""Errors of archival: one partition cannot be archived or restored, or its archive is damaged.

``ArchivalError`` is a ``metadata.partitions.PartitionError`` (archival is the last stage of a
partition's life, and the ``partitions`` command and the beat job handle both alike)::

    PartitionError                      metadata.partitions.errors
    └── ArchivalError                   archiving or restoring one partition cannot proceed
        └── ArchiveIntegrityError       an archive is damaged or does not match what was recorded
"""
from __future__ import annotations

from metadata.partitions.errors import PartitionError


class ArchivalError(PartitionError):
    """Archiving or restoring a partition cannot proceed (the job records why and resumes)."""


class ArchiveIntegrityError(ArchivalError):
    """An archive file is missing, damaged, or its rows or checksum differ from the record."""
