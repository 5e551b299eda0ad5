"""Premake and DEFAULT draining against the real catalog (bounds, not names; UTC)."""
from __future__ import annotations

import datetime as dt
import threading

import psycopg
import pytest
from django.db import connection

from metadata.partitions import (
    PARTITION_MAINTENANCE_LOCK,
    MaintenanceLockBusy,
    PartitionPolicy,
    PartitionRotation,
    TimeRange,
    catalog,
)
from metadata.partitions.maker import PartitionMaker
from metadata.partitions.locks import session_settings
from tests.metadata.partition_helpers import day, insert_tokens, row_count

ONLY_TOKENS = {"metadata_token": "session_created_at"}
POLICY = PartitionPolicy(retention=dt.timedelta(days=10))


def token_ranges() -> list[TimeRange]:
    return [p.bounds for p in catalog.range_partitions("metadata_token")]


def rotate(now: dt.datetime, policy: PartitionPolicy = POLICY, tables=ONLY_TOKENS):
    return PartitionRotation(policy, tables=tables, progress=lambda _: None).run(now)


def test_premake_makes_the_current_bin_and_four_ahead_in_utc(partitioned) -> None:
    rotate(day(0, hour=23))
    assert token_ranges() == [TimeRange(day(n), day(n + 1)) for n in range(5)]
    # Indexes of the parent were made on each partition by ATTACH.
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_indexes WHERE tablename = %s", [f"metadata_token_p{day(2):%Y%m%d}"])
        assert cursor.fetchone()[0] == 1


def test_rotation_is_idempotent(partitioned) -> None:
    first = rotate(day(0))
    second = rotate(day(0))
    assert len(first.created) == 5 and second.created == []
    assert len(token_ranges()) == 5


def test_partitions_are_found_by_bounds_not_by_name(partitioned) -> None:
    rotate(day(0))
    with connection.cursor() as cursor:
        cursor.execute(f'ALTER TABLE "metadata_token_p{day(1):%Y%m%d}" RENAME TO tokens_renamed_by_an_operator')
    report = rotate(day(0))
    assert report.created == []  # the renamed table still covers day 1
    assert TimeRange(day(1), day(2)) in token_ranges()


def test_a_changed_interval_fills_only_the_gaps(partitioned) -> None:
    rotate(day(0))  # daily up to day 5
    hourly = PartitionPolicy(interval=dt.timedelta(hours=6), premake=30, retention=dt.timedelta(days=10))
    rotate(day(0), hourly)
    ranges = token_ranges()
    assert all(a.end <= b.start for a, b in zip(ranges, ranges[1:])), "no overlap"
    assert ranges[5] == TimeRange(day(5), day(5, hour=6))  # new 6-hour bins after the daily ones
    assert ranges[-1].end == day(7, hour=18)  # 31 bins of 6 h from day 0


def test_default_rows_are_drained_before_their_partition_is_attached(partitioned) -> None:
    insert_tokens(day(2, hour=5), 12_000)  # no partition yet: they land in DEFAULT
    insert_tokens(day(40, hour=1), 7)  # far future, beyond premake
    assert row_count("metadata_token_default") == 12_007
    policy = PartitionPolicy(retention=dt.timedelta(days=10), drain_batch_rows=5000)
    report = rotate(day(0), policy)
    assert report.drained_rows == 12_007
    assert row_count("metadata_token_default") == 0
    assert row_count(f"metadata_token_p{day(2):%Y%m%d}") == 12_000
    assert row_count(f"metadata_token_p{day(40):%Y%m%d}") == 7
    assert row_count("metadata_token") == 12_007


def test_a_half_drained_staging_table_is_finished_by_the_next_run(partitioned) -> None:
    insert_tokens(day(3), 300)
    maker = PartitionMaker("metadata_token", "session_created_at", PartitionPolicy(drain_batch_rows=100),
                           progress=lambda _: None)
    bounds = TimeRange(day(3), day(4))
    staging = maker._create_staging(bounds)
    with connection.cursor() as cursor:  # one committed batch moved, then the process "died"
        cursor.execute(maker._move_sql("metadata_token_default", staging, bounds, 100))
    assert catalog.staging_tables("metadata_token") == [(staging, bounds)]
    assert row_count("metadata_token") == 200  # the moved rows are invisible until ATTACH...
    rotate(day(0))
    assert catalog.staging_tables("metadata_token") == []
    assert catalog.attachment(staging) == ("metadata_token", False)
    assert row_count("metadata_token") == 300  # ...and none were lost


def test_a_second_run_is_refused_while_one_holds_the_advisory_lock(partitioned) -> None:
    params = session_settings()  # the primary itself: a lock through PgBouncer would outlive this test
    with psycopg.connect(dbname=params["NAME"], host=params["HOST"], port=params["PORT"], user=params["USER"],
                         autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (PARTITION_MAINTENANCE_LOCK,))
        with pytest.raises(MaintenanceLockBusy):
            rotate(day(0))
    assert token_ranges() == []
    rotate(day(0))  # the lock went with the other session
    assert len(token_ranges()) == 5


def test_attach_waits_out_a_lock_with_retries_instead_of_failing(partitioned, settings, caplog) -> None:
    """A reader holds the DEFAULT partition for a while: ATTACH times out, retries, then succeeds."""
    settings.SPECOPS_MAINTENANCE_LOCK_TIMEOUT_MS = 100
    params = connection.settings_dict
    holder = psycopg.connect(dbname=params["NAME"], host=params["HOST"], port=params["PORT"], user=params["USER"])
    holder.execute("LOCK TABLE metadata_token_default IN ACCESS SHARE MODE")  # transaction stays open
    release = threading.Timer(0.8, holder.commit)
    caplog.set_level("INFO", logger="metadata.partitions.locks")
    release.start()
    try:
        report = rotate(day(0))
    finally:
        release.join()
        holder.close()
    assert len(report.created) == 5
    assert any("lock timeout, retry" in r.getMessage() for r in caplog.records)

