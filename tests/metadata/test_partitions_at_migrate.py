"""``migrate`` makes the current and premade partitions: a new database's first rows never land in DEFAULT."""
from __future__ import annotations

import io

from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from metadata.models import PARTITIONED_TABLES
from metadata.partitions import PartitionPolicy, bin_start, catalog
from metadata.partitions import post_migrate as at_migrate
from tests.metadata.partition_helpers import insert_tokens, row_count


def partition_of(session_id) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT DISTINCT tableoid::regclass::text FROM metadata_token WHERE session_id = %s",
                       [session_id])
        return cursor.fetchone()[0]


def test_migrate_makes_the_current_and_premade_partitions(partitioned) -> None:
    assert catalog.range_partitions("metadata_token") == []  # as on a new database
    out = io.StringIO()
    call_command("migrate", stdout=out)
    policy = PartitionPolicy.from_settings()
    assert f"Made {len(PARTITIONED_TABLES) * (policy.premake + 1)} partition(s) ahead" in out.getvalue()
    for parent in PARTITIONED_TABLES:
        ranges = [p.bounds for p in catalog.range_partitions(parent)]
        assert len(ranges) == policy.premake + 1
        assert ranges[0].start == bin_start(timezone.now(), policy.interval)

    session_id = insert_tokens(timezone.now(), 3)  # the first rows of a new database
    assert partition_of(session_id) != "metadata_token_default"
    assert catalog.partition_covering("metadata_token", timezone.now()).name == partition_of(session_id)
    assert row_count("metadata_token_default") == 0

    again = io.StringIO()
    call_command("migrate", stdout=again)  # idempotent
    assert "Made" not in again.getvalue()
    assert len(catalog.range_partitions("metadata_token")) == policy.premake + 1


def test_flush_and_missing_tables_make_nothing(partitioned, monkeypatch) -> None:
    call_command("flush", interactive=False, verbosity=0)  # sends post_migrate too, without a plan
    assert catalog.range_partitions("metadata_token") == []
    monkeypatch.setattr(at_migrate, "PARTITIONED_TABLES", {"metadata_not_migrated_yet": "created_at"})
    out = io.StringIO()
    call_command("migrate", stdout=out)
    assert "partition" not in out.getvalue().lower()
    assert catalog.range_partitions("metadata_token") == []
