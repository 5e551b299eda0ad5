"""Fixtures for the metadata store tests (real PostgreSQL; partitions reset around each test)."""
from __future__ import annotations

from pathlib import Path

import pytest

from metadata.models import ModelVersion
from tests.metadata.partition_helpers import reset_partitions


@pytest.fixture
def model_version(db) -> ModelVersion:
    return ModelVersion.objects.create(name="m", version="1", role="target", path="/nonexistent", context_length=512)


@pytest.fixture
def archive_dir(tmp_path: Path, settings) -> Path:
    directory = tmp_path / "archive"
    settings.SPECOPS_ARCHIVE_DIR = directory
    settings.SPECOPS_MAINTENANCE_PAUSE_RATIO = 0  # unpaced here; test_pacing covers the pacer
    return directory


@pytest.fixture
def partitioned(transactional_db, archive_dir):
    """A clean partition layout (DEFAULT partitions only), restored after the test too.

    Transactional: DETACH/CREATE INDEX ... CONCURRENTLY and the crash tests need real commits.
    """
    reset_partitions()
    yield archive_dir
    reset_partitions()
