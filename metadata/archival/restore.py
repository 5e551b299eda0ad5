"""Bring an archived partition back from cold storage, verified, in one transaction.

The rows are imported into a new table shaped like the parent (``LIKE ... INCLUDING ALL``) and
their checksum, computed in SQL exactly as at export, must equal the manifest's before the
transaction commits: a damaged archive leaves nothing behind. By default the table stays
standalone (queryable, outside retention); ``attach=True`` puts it back into the parent, where
the next rotation will archive it again if it is still older than the retention.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.db import DEFAULT_DB_ALIAS, connections, transaction

from metadata.archival.errors import ArchivalError, ArchiveIntegrityError
from metadata.archival.files import (
    ArchiveManifest,
    file_sha256,
    import_archive,
    manifest_path,
)
from metadata.models import PARTITIONED_TABLES
from metadata.partitions import catalog
from metadata.partitions.bounds import TimeRange
from metadata.partitions.checksum import table_checksum
from metadata.partitions.ddl import add_bound_check, attach_checked_table
from metadata.partitions.errors import PartitionOverlapError
from metadata.partitions.locks import quote, with_lock_retries

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreResult:
    table: str
    rows: int
    checksum: str
    attached: bool


def restore_archive(
    archive: Path,
    into: str | None = None,
    attach: bool = False,
    progress: Callable[[str], None] | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> RestoreResult:
    """Re-import ``archive`` into table ``into`` (default: the partition's old name) and verify it."""
    progress = progress or logger.info
    archive = Path(archive)
    if not archive.is_file():
        raise ArchivalError(f"no archive file {archive}")
    manifest = ArchiveManifest.read(manifest_path(archive))
    try:
        sha256 = file_sha256(archive)
    except OSError as exc:
        raise ArchivalError(f"cannot read {archive}: {exc}") from exc
    if sha256 != manifest.file_sha256:
        raise ArchiveIntegrityError(f"{archive} is damaged: its sha256 differs from the manifest's")
    name = into or manifest.partition
    parent = manifest.parent_table
    if catalog.relation_exists(name, using):
        raise ArchivalError(f"a table named {name} already exists; choose another with --into")
    if not catalog.relation_exists(parent, using):
        raise ArchivalError(f"the parent table {parent} does not exist")
    start, end = manifest.bounds
    bounds = TimeRange(start, end)
    if attach:
        clash = [p.name for p in catalog.range_partitions(parent, using) if p.bounds.overlaps(bounds)]
        if clash:
            raise PartitionOverlapError(f"{', '.join(clash)} already covers part of {bounds}; restore without --attach")
    with transaction.atomic(using=using):
        with connections[using].cursor() as cursor:
            cursor.execute(f"CREATE TABLE {quote(name)} (LIKE {quote(parent)} INCLUDING ALL)")
        import_archive(archive, name, manifest.columns, progress, using)
        rows, checksum = table_checksum(name, manifest.columns, using)
        if (rows, checksum) != (manifest.row_count, manifest.checksum):
            raise ArchiveIntegrityError(
                f"restored rows do not match the manifest: {rows} rows, checksum {checksum[:12]}... "
                f"vs {manifest.row_count} rows, {manifest.checksum[:12]}..."
            )
        progress(f"{name}: {rows} row(s) restored, checksum verified")
        if attach:
            add_bound_check(name, manifest.partition_column or PARTITIONED_TABLES[parent], bounds, using)
            with_lock_retries(lambda: attach_checked_table(parent, name, bounds, using), f"attach {name}", using)
            progress(f"{name}: attached to {parent} {bounds}")
    return RestoreResult(name, rows, checksum, attach)

