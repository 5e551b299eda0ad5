"""The public APIs of ``metadata.partitions`` and ``metadata.archival``, their errors, their import order."""
from __future__ import annotations

import importlib
import sys

import pytest
from django.core.exceptions import ImproperlyConfigured

import metadata.archival
import metadata.partitions
from metadata.archival import ArchivalError, ArchiveIntegrityError
from metadata.partitions import (
    BadIntervalError,
    BoundsError,
    MaintenanceLockBusy,
    PartitionError,
    PartitionLookupError,
    PartitionOverlapError,
    PartitionPolicyError,
    parse_interval,
)


@pytest.mark.parametrize("package", [metadata.partitions, metadata.archival])
def test_every_exported_name_exists(package) -> None:
    assert package.__doc__
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert missing == []


def test_one_base_for_every_partition_and_archival_error() -> None:
    for error in (ArchivalError, ArchiveIntegrityError, BadIntervalError, BoundsError, MaintenanceLockBusy,
                  PartitionLookupError, PartitionOverlapError, PartitionPolicyError):
        assert issubclass(error, PartitionError)
    assert issubclass(ArchiveIntegrityError, ArchivalError)
    assert issubclass(PartitionPolicyError, ImproperlyConfigured)  # Django's word for a bad setting
    assert metadata.archival.ArchivalError is ArchivalError
    with pytest.raises(BadIntervalError):
        parse_interval("fortnightly")


@pytest.mark.parametrize("first", ["metadata.archival", "metadata.archival.restore", "metadata.partitions.catalog",
                                   "metadata.partitions"])
def test_either_package_can_be_imported_first(first: str) -> None:
    """archival is built on partitions' modules and the rotation uses archival: neither may need
    the other half-loaded, whichever a process imports first."""
    names = [n for n in sys.modules if n.startswith(("metadata.partitions", "metadata.archival"))]
    saved = {n: sys.modules.pop(n) for n in names}
    try:
        importlib.import_module(first)
        importlib.import_module("metadata.archival")
        rotation = importlib.import_module("metadata.partitions").PartitionRotation
        assert rotation.__module__ == "metadata.partitions.lifecycle"
    finally:
        for name in [n for n in sys.modules if n.startswith(("metadata.partitions", "metadata.archival"))]:
            del sys.modules[name]
        sys.modules.update(saved)
        metadata.partitions = saved["metadata.partitions"]  # the parent package's attributes too
        metadata.archival = saved["metadata.archival"]
