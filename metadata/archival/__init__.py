"""Partitions to cold storage and back: detach, export, verify, drop; restore; the archive files.

``PartitionArchiver`` moves one partition out step by step (``detached``, ``exported``,
``verified``, ``dropped``), recording each on its ``PartitionArchivalJob`` so a crash resumes
where it stopped; nothing is dropped before the archive, re-imported, gives the table's row count
and checksum. ``restore_archive`` brings an archive back, verified, standalone or attached.
Failures are ``ArchivalError`` (a ``metadata.partitions.PartitionError``); a damaged or mismatched
archive is ``ArchiveIntegrityError`` (both in ``errors``).

Modules: ``archiver`` (the steps and their jobs), ``files`` (archive and manifest files),
``restore``, ``families`` (a day of sessions with its tokens and candidates), ``errors``.

This package sits above ``metadata.partitions``: it is built on its catalog, bounds, locks, DDL,
pacing and row checksums, and ``metadata.partitions`` never imports it. The rotation archives
expired partitions through ``metadata.partitions.archiving.Archiver``; the app registers
``PartitionArchiver`` as that archiver when it starts (``MetadataConfig.ready``).
"""
from __future__ import annotations

from metadata.archival.archiver import STEP_ORDER, UNFINISHED, CrashPoint, InjectedCrash, PartitionArchiver, resume_step
from metadata.archival.errors import ArchivalError, ArchiveIntegrityError
from metadata.archival.families import archived_days, archived_session_job
from metadata.archival.files import (
    ArchiveManifest,
    archive_path,
    checksum_of_archive,
    export_table,
    file_sha256,
    import_archive,
    manifest_path,
)
from metadata.archival.restore import RestoreResult, restore_archive
from metadata.partitions.checksum import table_checksum

__all__ = [
    "STEP_ORDER", "UNFINISHED",
    "ArchivalError", "ArchiveIntegrityError", "ArchiveManifest", "CrashPoint", "InjectedCrash", "PartitionArchiver",
    "RestoreResult",
    "archive_path", "archived_days", "archived_session_job", "checksum_of_archive", "export_table", "file_sha256", "import_archive", "manifest_path",
    "restore_archive", "resume_step", "table_checksum",
]
