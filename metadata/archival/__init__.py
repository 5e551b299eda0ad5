"""Partitions to cold storage and back: detach, export, verify, drop; restore; the archive files.

``PartitionArchiver`` moves one partition out step by step (``detached``, ``exported``,
``verified``, ``dropped``), recording each on its ``PartitionArchivalJob`` so a crash resumes
where it stopped; nothing is dropped before the archive, re-imported, gives the table's row count
and checksum. ``restore_archive`` brings an archive back, verified, standalone or attached.
Failures are ``ArchivalError`` (a ``metadata.partitions.PartitionError``); a damaged or mismatched
archive is ``ArchiveIntegrityError``.

Modules: ``archiver`` (the steps and their jobs), ``files`` (archive and manifest files, row
checksums computed in SQL), ``restore``. Built on ``metadata.partitions``' catalog, locks, DDL and
pacing, imported from those modules: the package's own API also holds the rotation, which uses
this package.
"""
from __future__ import annotations

from metadata.archival.archiver import STEP_ORDER, UNFINISHED, CrashPoint, InjectedCrash, PartitionArchiver, resume_step
from metadata.archival.files import (
    ArchiveManifest,
    archive_path,
    checksum_of_archive,
    export_table,
    file_sha256,
    import_archive,
    manifest_path,
    table_checksum,
)
from metadata.archival.restore import RestoreResult, restore_archive
from metadata.partitions.errors import ArchivalError, ArchiveIntegrityError

__all__ = [
    "STEP_ORDER", "UNFINISHED",
    "ArchivalError", "ArchiveIntegrityError", "ArchiveManifest", "CrashPoint", "InjectedCrash", "PartitionArchiver",
    "RestoreResult",
    "archive_path", "checksum_of_archive", "export_table", "file_sha256", "import_archive", "manifest_path",
    "restore_archive", "resume_step", "table_checksum",
]
