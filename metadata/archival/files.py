"""Cold-storage archives of partitions: gzip'd COPY text plus a JSON manifest, and checksums.

An archive is ``<table>.<job>.copy.gz`` (the rows, ``COPY ... TO STDOUT`` text format) next to
``<table>.<job>.json`` (bounds, columns, row count, row checksum, file sha256), so ``restore``
needs nothing but the two files. The row checksum is ``metadata.partitions.checksum``'s, computed
*in SQL* over every row's text under fixed output settings and order-independent, so the live
table and the file re-imported into a scratch table must agree.
"""
from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from django.db import DEFAULT_DB_ALIAS, connections

from metadata.archival.errors import ArchiveIntegrityError
from metadata.partitions.checksum import set_canonical_output, table_checksum
from metadata.partitions.locks import quote

MANIFEST_FORMAT = "specops-partition-archive/1"
ARCHIVE_SUFFIX = ".copy.gz"
MANIFEST_SUFFIX = ".json"
COMPRESS_LEVEL = 3  # archival competes with writers for CPU; level 3 is ~3x faster than 9
COPY_PROGRESS_EVERY = 200_000  # rows between progress lines

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ArchiveManifest:
    """What an archive holds; written next to it once the export is complete."""

    parent_table: str
    partition: str
    partition_column: str
    range_start: str
    range_end: str
    columns: list[str]
    row_count: int
    checksum: str
    file_sha256: str
    file_bytes: int
    job_id: int | None
    exported_at: str
    format: str = MANIFEST_FORMAT

    def write(self, path: Path) -> None:
        _atomic_write(path, json.dumps(asdict(self), indent=2).encode())

    @classmethod
    def read(cls, path: Path) -> ArchiveManifest:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ArchiveIntegrityError(f"no manifest {path} next to the archive") from exc
        except ValueError as exc:
            raise ArchiveIntegrityError(f"manifest {path} is not valid JSON") from exc
        if data.get("format") != MANIFEST_FORMAT:
            raise ArchiveIntegrityError(f"manifest {path} is not a {MANIFEST_FORMAT} manifest")
        try:
            return cls(**data)
        except TypeError as exc:  # a field missing or unknown
            raise ArchiveIntegrityError(f"manifest {path} does not match {MANIFEST_FORMAT}: {exc}") from exc

    @property
    def bounds(self) -> tuple[dt.datetime, dt.datetime]:
        return dt.datetime.fromisoformat(self.range_start), dt.datetime.fromisoformat(self.range_end)


def archive_path(archive_dir: Path, parent_table: str, partition: str, job_id: int) -> Path:
    return Path(archive_dir) / parent_table / f"{partition}.{job_id}{ARCHIVE_SUFFIX}"


def manifest_path(archive: Path) -> Path:
    name = archive.name
    stem = name[: -len(ARCHIVE_SUFFIX)] if name.endswith(ARCHIVE_SUFFIX) else archive.stem
    return archive.with_name(stem + MANIFEST_SUFFIX)


def _atomic_write(path: Path, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as fh:
        fh.write(payload)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def export_table(
    table: str, columns: list[str], target: Path, progress: Progress, using: str = DEFAULT_DB_ALIAS,
    pace: Callable[[], None] = lambda: None,
) -> int:
    """COPY ``table`` into gzip'd ``target`` (written as ``.part``, fsynced, renamed); rows out.

    Call inside a transaction so the rows and a checksum taken in it are one snapshot.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    cols = ", ".join(quote(c, using) for c in columns)
    rows = 0
    next_report = COPY_PROGRESS_EVERY
    with open(tmp, "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=COMPRESS_LEVEL) as out:
            with connections[using].cursor() as cursor:
                set_canonical_output(cursor)
                with cursor.copy(f"COPY {quote(table, using)} ({cols}) TO STDOUT") as copy:
                    for chunk in copy:
                        out.write(chunk)
                        rows += bytes(chunk).count(b"\n")
                        pace()
                        if rows >= next_report:
                            progress(f"{table}: exported {rows} rows")
                            next_report += COPY_PROGRESS_EVERY
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, target)
    return rows


def import_archive(
    archive: Path, table: str, columns: list[str], progress: Progress, using: str = DEFAULT_DB_ALIAS,
    pace: Callable[[], None] = lambda: None,
) -> int:
    """COPY the rows of ``archive`` into ``table`` (inside the caller's transaction); rows in."""
    cols = ", ".join(quote(c, using) for c in columns)
    rows = 0
    next_report = COPY_PROGRESS_EVERY
    try:
        with gzip.open(archive, "rb") as source, connections[using].cursor() as cursor:
            set_canonical_output(cursor)
            with cursor.copy(f"COPY {quote(table, using)} ({cols}) FROM STDIN") as copy:
                for block in iter(lambda: source.read(1 << 18), b""):
                    copy.write(block)
                    rows += block.count(b"\n")
                    pace()
                    if rows >= next_report:
                        progress(f"{table}: imported {rows} rows")
                        next_report += COPY_PROGRESS_EVERY
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise ArchiveIntegrityError(f"cannot read {archive}: {exc}") from exc
    return rows


def checksum_of_archive(
    archive: Path, parent_table: str, columns: list[str], progress: Progress, using: str = DEFAULT_DB_ALIAS,
    pace: Callable[[], None] = lambda: None,
) -> tuple[int, str]:
    """Re-import ``archive`` into a scratch temp table shaped like ``parent_table``; checksum it.

    Call inside a transaction: the temp table is dropped at commit.
    """
    scratch = "specops_archive_verify"
    with connections[using].cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS pg_temp.{quote(scratch, using)}")
        cursor.execute(
            f"CREATE TEMP TABLE {quote(scratch, using)} (LIKE {quote(parent_table, using)} INCLUDING DEFAULTS) "
            "ON COMMIT DROP"
        )
    import_archive(archive, scratch, columns, progress, using, pace)
    return table_checksum(scratch, columns, using)
