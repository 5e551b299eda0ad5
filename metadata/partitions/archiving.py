"""What the rotation needs from an archiver, and the one the app registers for it.

The rotation's last stage moves expired partitions to cold storage, which ``metadata.archival``
does. That package is built on this one (catalog, bounds, locks, DDL, pacing), so this package
never imports it: the rotation talks to an ``Archiver`` (the methods it calls, nothing more), and
the app registers the real one, ``metadata.archival.PartitionArchiver``, when it starts
(``MetadataConfig.ready``). A test or a tool may register another.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from metadata.models import PartitionArchivalJob
from metadata.partitions.catalog import PartitionInfo
from metadata.partitions.errors import PartitionError
from metadata.partitions.pacing import Pacer


class Archiver(Protocol):
    """Archives one partition at a time through resumable jobs (``PartitionArchivalJob``)."""

    archive_dir: Path

    def unfinished_jobs(self) -> list[PartitionArchivalJob]: ...

    def unfinished_job(self, pk: int) -> PartitionArchivalJob | None: ...

    def remaining_steps(self, job: PartitionArchivalJob) -> tuple[str, ...]: ...

    def job_for(self, partition: PartitionInfo) -> PartitionArchivalJob: ...

    def archive(self, job: PartitionArchivalJob) -> PartitionArchivalJob: ...


# (archive_dir, progress, crash_at, using, pacer) -> an Archiver; crash_at is the archiver's own
# crash point (tests only), passed through untouched.
ArchiverFactory = Callable[[Path | None, Callable[[str], None], Any, str, Pacer], Archiver]

_factory: ArchiverFactory | None = None


def register_archiver(factory: ArchiverFactory) -> None:
    """Make ``factory`` the one every rotation builds its archiver with (the last one wins)."""
    global _factory
    _factory = factory


def make_archiver(archive_dir: Path | None, progress: Callable[[str], None], crash_at: Any, using: str,
                  pacer: Pacer) -> Archiver:
    """An archiver from the registered factory; ``PartitionError`` if the app registered none."""
    if _factory is None:
        raise PartitionError("no archiver is registered: MetadataConfig.ready() registers "
                             "metadata.archival.PartitionArchiver (is the metadata app installed?)")
    return _factory(archive_dir, progress, crash_at, using, pacer)
