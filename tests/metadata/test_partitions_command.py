"""``manage.py partitions``: status, rotate, archive, restore; errors are one line, exit non-zero."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection

from metadata.models import PARTITIONED_TABLES, ArchivalStep, PartitionArchivalJob
from metadata.partitions import PARTITION_MAINTENANCE_LOCK, catalog
from metadata.partitions.locks import session_settings
from tests.metadata.partition_helpers import day, insert_tokens, row_count

ROOT = Path(settings.BASE_DIR)


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("partitions", *args, stdout=out)
    return out.getvalue()


def manage(*args: str) -> subprocess.CompletedProcess:
    """Run the real command line against the test database."""
    params = connection.settings_dict
    env = {**os.environ, "DATABASE_URL": f"postgres://{params['USER']}@{params['HOST']}:{params['PORT']}/{params['NAME']}",
           "DATABASE_REPLICA_URLS": "", "SPECOPS_ARCHIVE_DIR": str(settings.SPECOPS_ARCHIVE_DIR)}
    return subprocess.run([sys.executable, "manage.py", "partitions", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_rotate_then_status_shows_partitions_by_bounds(partitioned) -> None:
    insert_tokens(day(40), 5)  # stranded far ahead: shows in DEFAULT until drained
    out = run("rotate", "--now", day(0).isoformat())
    assert f"created {5 * len(PARTITIONED_TABLES) + 1} partition(s), drained 5 row(s)" in out  # 5 per table + the far-ahead day
    status = run("status")
    assert f"metadata_token_p{day(0):%Y%m%d}" in status and "2030-01-01 00:00 .. 2030-01-02 00:00 UTC" in status
    assert "DEFAULT metadata_token_default: 0 row(s)" in status


def test_archive_and_restore_through_the_command(partitioned) -> None:
    run("rotate", "--now", day(0).isoformat())
    insert_tokens(day(1, hour=2), 40)
    name = f"metadata_token_p{day(1):%Y%m%d}"
    out = run("archive", name)
    assert f"{name}: 40 row(s) archived to" in out and "(4/4)" in out
    job = PartitionArchivalJob.objects.using("default").get(partition=name)
    assert job.step == ArchivalStep.DROPPED and not catalog.relation_exists(name)
    out = run("restore", job.archive_path, "--into", "restored_by_command")
    assert f"restored 40 row(s) into restored_by_command as a standalone table; checksum {job.checksum}" in out
    assert row_count("restored_by_command") == 40


@pytest.mark.parametrize(
    "args, message",
    [
        (("archive", "no_such_partition"), "partitions archive: no partition named no_such_partition"),
        (("archive", "metadata_token_default"), "is the DEFAULT partition"),
        (("restore", "/nonexistent/x.copy.gz"), "partitions restore: no archive file /nonexistent/x.copy.gz"),
        (("rotate", "--now", "2030-01-01"), "needs a UTC offset"),
        (("rotate", "--now", "yesterday"), "partitions rotate: Invalid isoformat string"),
    ],
)
def test_operator_mistakes_are_one_line_errors(partitioned, args, message) -> None:
    with pytest.raises(CommandError, match=message) as raised:
        run(*args)
    assert "\n" not in str(raised.value)


def test_the_command_line_prints_one_line_and_exits_non_zero(partitioned) -> None:
    result = manage("archive", "no_such_partition")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "CommandError: partitions archive: no partition named no_such_partition is attached to a partitioned table"
    ]
    usage = manage("frobnicate")
    assert usage.returncode == 2 and len(usage.stderr.strip().splitlines()) == 1


def test_rotate_refuses_to_overlap_a_running_rotation(partitioned) -> None:
    params = session_settings()  # the primary itself: a lock through PgBouncer would outlive this test
    with psycopg.connect(dbname=params["NAME"], host=params["HOST"], port=params["PORT"], user=params["USER"],
                         autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (PARTITION_MAINTENANCE_LOCK,))
        result = manage("rotate")
    assert result.returncode == 1
    assert result.stderr.strip() == "CommandError: partitions rotate: another maintenance run holds the lock; try again later"
