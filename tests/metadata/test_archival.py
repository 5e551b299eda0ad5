"""Archival: detach, export, verify, drop; crash at every step and resume; restore verifies."""
from __future__ import annotations

import datetime as dt
import gzip
from pathlib import Path

import psycopg
import pytest
from django.db import DEFAULT_DB_ALIAS, connection, transaction
from django.test.utils import CaptureQueriesContext

from metadata.archival import (
    ArchiveIntegrityError,
    CrashPoint,
    InjectedCrash,
    PartitionArchiver,
    restore_archive,
    table_checksum,
)
from metadata.models import ArchivalStep, PartitionArchivalJob
from metadata.partitions import (
    PartitionOverlapError,
    PartitionPolicy,
    PartitionRotation,
    catalog,
)
from metadata.partitions.locks import session_alias
from tests.metadata.partition_helpers import day, insert_tokens, row_count, token_keys

ONLY_TOKENS = {"metadata_token": "session_created_at"}
STEPS = [ArchivalStep.DETACHED, ArchivalStep.EXPORTED, ArchivalStep.VERIFIED, ArchivalStep.DROPPED]
PARTITION = f"metadata_token_p{day(1):%Y%m%d}"


def checksum_of(table: str) -> tuple[int, str]:
    with transaction.atomic():
        return table_checksum(table, catalog.table_columns("metadata_token"))


@pytest.fixture
def old_partition(partitioned) -> tuple[int, str]:
    """Day-1 partition with 500 rows (two sessions) and the checksum it had before archival."""
    PartitionRotation(PartitionPolicy(retention=dt.timedelta(days=1000)), tables=ONLY_TOKENS,
                      progress=lambda _: None).run(day(1))
    insert_tokens(day(1, hour=3), 300)
    insert_tokens(day(1, hour=20), 200)
    insert_tokens(day(2, hour=1), 50)  # a neighbour that must stay
    return checksum_of(PARTITION)


def archive_day_one(crash_at: CrashPoint | None = None) -> PartitionArchivalJob:
    archiver = PartitionArchiver(crash_at=crash_at, progress=lambda _: None)
    if crash_at is None and archiver.unfinished_jobs():
        return archiver.archive(archiver.unfinished_jobs()[0])
    partition = next(p for p in catalog.range_partitions("metadata_token") if p.name == PARTITION)
    return archiver.archive(archiver.job_for(partition))


def test_archive_records_every_step_and_restore_gives_the_same_checksum(old_partition, archive_dir) -> None:
    before = old_partition
    keys_before = token_keys(PARTITION)
    job = archive_day_one()
    assert job.step == ArchivalStep.DROPPED and job.finished_at is not None
    assert (job.row_count, job.checksum) == before
    assert not catalog.relation_exists(PARTITION)
    assert row_count("metadata_token") == 50
    archive = Path(job.archive_path)
    assert archive.parent.parent == archive_dir and archive.stat().st_size == job.archive_bytes
    with gzip.open(archive, "rt") as fh:
        assert sum(1 for _ in fh) == 500

    restored = restore_archive(archive, into="restored_day_one", progress=lambda _: None)
    assert (restored.rows, restored.checksum) == before
    assert token_keys("restored_day_one") == keys_before
    assert checksum_of("restored_day_one") == before


@pytest.mark.parametrize("after_record", [False, True], ids=["before-record", "after-record"])
@pytest.mark.parametrize("step", STEPS)
def test_a_crash_at_any_step_is_resumed_by_the_next_run(old_partition, step, after_record) -> None:
    before = old_partition
    keys_before = token_keys(PARTITION)
    with pytest.raises(InjectedCrash):
        archive_day_one(CrashPoint(step, after_record))
    job = PartitionArchivalJob.objects.using("default").get()
    expected_step = step if after_record else STEPS[STEPS.index(step) - 1] if step != STEPS[0] else ArchivalStep.PENDING
    assert job.step == expected_step  # the row lags the database when the crash came before recording

    if step == ArchivalStep.DROPPED and after_record:
        resumed = job  # nothing left to do
    else:
        resumed = archive_day_one()
    assert resumed.step == ArchivalStep.DROPPED, resumed.error
    assert PartitionArchivalJob.objects.using("default").count() == 1  # resumed, not redone as a second job
    assert (resumed.row_count, resumed.checksum) == before
    assert not catalog.relation_exists(PARTITION)
    assert row_count("metadata_token") == 50  # neighbours untouched, nothing duplicated

    restored = restore_archive(Path(resumed.archive_path), into="restored_after_crash", progress=lambda _: None)
    assert (restored.rows, restored.checksum) == before
    assert token_keys("restored_after_crash") == keys_before


def test_a_damaged_archive_fails_verification_and_is_written_again(old_partition) -> None:
    with pytest.raises(InjectedCrash):
        archive_day_one(CrashPoint(ArchivalStep.EXPORTED, after_record=True))
    job = PartitionArchivalJob.objects.using("default").get()
    Path(job.archive_path).write_bytes(gzip.compress(b"garbage\n"))

    failed = archive_day_one()
    assert failed.step == ArchivalStep.FAILED and failed.failed_step == ArchivalStep.VERIFIED
    assert "sha256" in failed.error and failed.attempts == 1
    assert catalog.relation_exists(PARTITION), "never dropped without a verified archive"

    resumed = archive_day_one()
    assert resumed.step == ArchivalStep.DROPPED
    assert (resumed.row_count, resumed.checksum) == old_partition


def test_restore_refuses_a_damaged_archive_and_leaves_nothing(old_partition) -> None:
    job = archive_day_one()
    archive = Path(job.archive_path)
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    with pytest.raises(ArchiveIntegrityError, match="damaged"):
        restore_archive(archive, progress=lambda _: None)
    assert not catalog.relation_exists(PARTITION)


def test_restore_with_attach_puts_the_rows_back_behind_the_parent(old_partition) -> None:
    job = archive_day_one()
    result = restore_archive(Path(job.archive_path), attach=True, progress=lambda _: None)
    assert result.attached and catalog.attachment(PARTITION) == ("metadata_token", False)
    assert row_count("metadata_token") == 550
    with pytest.raises(PartitionOverlapError, match="already"):
        restore_archive(Path(job.archive_path), into="twice", attach=True, progress=lambda _: None)


def test_detach_retries_past_a_long_reader_and_gives_up_cleanly(old_partition, settings) -> None:
    """Plain DETACH (a DEFAULT exists) needs ACCESS EXCLUSIVE: it must time out, not queue writers."""
    settings.SPECOPS_MAINTENANCE_LOCK_TIMEOUT_MS = 50
    settings.SPECOPS_MAINTENANCE_LOCK_RETRIES = 2
    params = connection.settings_dict
    with psycopg.connect(dbname=params["NAME"], host=params["HOST"], port=params["PORT"], user=params["USER"]) as reader:
        reader.execute("SELECT count(*) FROM metadata_token")  # holds ACCESS SHARE until commit
        job = archive_day_one()
        reader.rollback()
    assert job.step == ArchivalStep.FAILED and job.failed_step == ArchivalStep.DETACHED
    assert "no lock after 3 attempts" in job.error
    assert catalog.attachment(PARTITION) == ("metadata_token", False)
    assert archive_day_one().step == ArchivalStep.DROPPED  # the next run resumes


def test_without_a_default_partition_the_detach_runs_concurrently(old_partition) -> None:
    """DETACH ... CONCURRENTLY is refused while a DEFAULT exists; where none does, it is used."""
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE metadata_token_default")
    try:
        with CaptureQueriesContext(connection) as captured:
            job = archive_day_one()
        assert job.step == ArchivalStep.DROPPED and (job.row_count, job.checksum) == old_partition
        if session_alias() == DEFAULT_DB_ALIAS:  # else it ran on a fresh direct connection (PgBouncer)
            detaches = [q["sql"] for q in captured.captured_queries if "DETACH PARTITION" in q["sql"]]
            assert len(detaches) == 1 and detaches[0].endswith("CONCURRENTLY")
    finally:
        with connection.cursor() as cursor:
            cursor.execute("CREATE TABLE metadata_token_default PARTITION OF metadata_token DEFAULT")
