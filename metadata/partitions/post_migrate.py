"""Make the current and premade partitions at ``migrate``, so a new database never starts on DEFAULT.

Without this no range partition exists until beat's first rotation, up to an hour later, and
every row written until then lands in the DEFAULT partition. ``MetadataConfig.ready()`` connects
``make_partitions_after_migrate`` to ``post_migrate``; it runs the rotation's make-ahead part only
(the bin holding now and ``premake`` bins ahead: no stranded bins, no archival), unpaced since
``migrate`` is a step someone waits for. Idempotent: what exists is left alone. Skipped, saying
nothing, when ``flush`` sends the signal (it empties tables and leaves partitions as they are),
on a database the router keeps this app off, and for tables not migrated yet; skipped with a
line when another maintenance run holds the lock (that run makes them).
"""
from __future__ import annotations

import sys
from typing import TextIO

from django.apps import AppConfig
from django.db import DEFAULT_DB_ALIAS, router

from metadata.models import PARTITIONED_TABLES
from metadata.partitions import catalog
from metadata.partitions.errors import MaintenanceLockBusy
from metadata.partitions.lifecycle import PartitionRotation
from metadata.partitions.pacing import Pacer


def make_partitions_after_migrate(sender: AppConfig, using: str = DEFAULT_DB_ALIAS, plan: list | None = None,
                                  verbosity: int = 1, stdout: TextIO | None = None, **kwargs) -> None:
    """The ``post_migrate`` receiver (sender: this app's config)."""
    if plan is None or not router.allow_migrate(using, sender.label):
        return
    tables = {parent: column for parent, column in PARTITIONED_TABLES.items() if catalog.relation_exists(parent, using)}
    if not tables:
        return
    out = stdout or sys.stdout

    def say(line: str) -> None:
        out.write(line + "\n")

    rotation = PartitionRotation(tables=tables, using=using, pacer=Pacer(0),
                                 progress=say if verbosity >= 2 else lambda _: None)
    try:
        report = rotation.make_ahead()
    except MaintenanceLockBusy as exc:
        if verbosity:
            say(f"  Partitions not made ahead: {exc}")
        return
    if report.created and verbosity:
        say(f"  Made {len(report.created)} partition(s) ahead ({rotation.policy.describe()}) "
            f"for {', '.join(tables)}")
