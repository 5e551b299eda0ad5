"""The rotation as a plan: ``--dry-run`` prints it and changes nothing; applying it does what it said."""
from __future__ import annotations

import datetime as dt
import io
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection

from metadata.archival import CrashPoint, InjectedCrash, PartitionArchiver
from metadata.models import PARTITIONED_TABLES, ArchivalStep, PartitionArchivalJob
from metadata.partitions import PartitionPolicy, PartitionRotation, TimeRange, catalog
from metadata.partitions.maker import PartitionMaker
from tests.metadata.partition_helpers import day, insert_tokens, row_count

ONLY_TOKENS = {"metadata_token": "session_created_at"}


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("partitions", *args, stdout=out)
    return out.getvalue()


def catalog_snapshot(archive_dir: Path) -> dict:
    """Everything a rotation could change: relations, attachments and bounds, constraints,
    comments, row counts, archival jobs, archive files."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, c.relkind, c.relispartition, obj_description(c.oid, 'pg_class'), "
            "pg_get_expr(c.relpartbound, c.oid), p.relname FROM pg_class c "
            "LEFT JOIN pg_inherits i ON i.inhrelid = c.oid LEFT JOIN pg_class p ON p.oid = i.inhparent "
            "WHERE c.relname LIKE 'metadata\\_%%' ORDER BY 1"
        )
        relations = cursor.fetchall()
        cursor.execute("SELECT conname, conrelid::regclass::text FROM pg_constraint "
                       "WHERE conrelid::regclass::text LIKE 'metadata\\_%%' ORDER BY 1, 2")
        constraints = cursor.fetchall()
    rows = {name: row_count(name) for name in ("metadata_token", "metadata_token_default")}
    jobs = list(PartitionArchivalJob.objects.using("default").order_by("pk").values_list("pk", "step", "updated_at"))
    files = sorted(str(p) for p in archive_dir.rglob("*")) if archive_dir.exists() else []
    return {"relations": relations, "constraints": constraints, "rows": rows, "jobs": jobs, "files": files}


@pytest.fixture
def busy_layout(partitioned, settings) -> Path:
    """Partitions of days 0-4, a crashed archival, a half-drained staging table and stranded rows."""
    settings.SPECOPS_PARTITION_RETENTION_DAYS = 10
    run("rotate", "--now", day(0).isoformat())
    insert_tokens(day(1, hour=2), 40)
    insert_tokens(day(2, hour=2), 30)
    crashed = next(p for p in catalog.range_partitions("metadata_token") if p.bounds.start == day(2))
    archiver = PartitionArchiver(crash_at=CrashPoint(ArchivalStep.EXPORTED), progress=lambda _: None)
    with pytest.raises(InjectedCrash):
        archiver.archive(archiver.job_for(crashed))
    insert_tokens(day(25, hour=1), 300)
    maker = PartitionMaker("metadata_token", "session_created_at", PartitionPolicy(drain_batch_rows=100),
                           progress=lambda _: None)
    staging = maker._create_staging(TimeRange(day(25), day(26)))
    with connection.cursor() as cursor:  # one committed batch moved, then the process "died"
        cursor.execute(maker._move_sql("metadata_token_default", staging, TimeRange(day(25), day(26)), 100))
    insert_tokens(day(40), 5)
    return partitioned


def test_dry_run_prints_every_step_and_changes_nothing(busy_layout) -> None:
    before = catalog_snapshot(busy_layout)
    out = run("rotate", "--dry-run", "--now", day(20).isoformat())
    assert catalog_snapshot(busy_layout) == before

    lines = out.splitlines()
    assert lines[0] == ("Rotation plan as of 2030-01-21 00:00:00 UTC (1 day interval, 4 made ahead, "
                        f"retention 10 days); archives go to {busy_layout}")
    assert "metadata_token (RANGE on session_created_at):" in lines
    text = "\n".join(lines)
    assert "  create   metadata_token_p20300121" in text and "2030-01-21 00:00 .. 2030-01-22 00:00 UTC" in text
    assert "  finish   metadata_token_p20300126" in text and "(half-drained by an earlier run)" in text
    assert "  drain    200 row(s) from DEFAULT into metadata_token_p20300126" in text
    assert "  drain    5 row(s) from DEFAULT into metadata_token_p20300210" in text
    assert "  archive  metadata_token_p20300102           2030-01-02 00:00 .. 2030-01-03 00:00 UTC  ~" in text
    assert "  drop     metadata_token_p20300102 once its archive is verified" in text
    job = PartitionArchivalJob.objects.using("default").get()
    assert (f"  archive  metadata_token_p20300103           2030-01-03 00:00 .. 2030-01-04 00:00 UTC "
            f"(resumes job {job.pk} after detached)") in text
    assert "  DEFAULT  205 row(s) now; 0 left after this plan" in text
    tables = len(PARTITIONED_TABLES)  # 5 per table made or archived, + 2 far-ahead token days
    assert lines[-2:] == [f"create {5 * tables + 2} partition(s), drain 205 row(s) from DEFAULT, "
                          f"archive {5 * tables} partition(s), drop {5 * tables}",
                          "dry run: nothing changed"]

    applied = run("rotate", "--now", day(20).isoformat())
    assert (f"created {5 * tables + 2} partition(s), drained 205 row(s) from DEFAULT, "
            f"archived {5 * tables}, failed 0") in applied
    assert row_count("metadata_token_default") == 0
    assert PartitionArchivalJob.objects.using("default").filter(step=ArchivalStep.DROPPED).count() == 5 * tables


def test_the_plan_matches_what_the_rotation_then_does(partitioned) -> None:
    insert_tokens(day(3, hour=4), 12)
    rotation = PartitionRotation(PartitionPolicy(retention=dt.timedelta(days=10)), tables=ONLY_TOKENS,
                                 progress=lambda _: None)
    plan = rotation.plan(day(0))
    assert [c.bounds for c in plan.creations] == [TimeRange(day(n), day(n + 1)) for n in range(5)]
    assert [c.default_rows for c in plan.creations] == [0, 0, 0, 12, 0] and plan.archivals == []
    assert plan.default_rows == {"metadata_token": 12}
    report = plan.apply()
    assert report.created == [c.name for c in plan.creations] and report.drained_rows == 12


def test_a_stale_plan_skips_what_another_run_did_since(partitioned) -> None:
    rotation = PartitionRotation(PartitionPolicy(retention=dt.timedelta(days=1)), tables=ONLY_TOKENS,
                                 progress=lambda _: None)
    rotation.run(day(0))
    stale = rotation.plan(day(3))  # would archive days 0-1 and make days 5-7
    assert len(stale.creations) == 3 and len(stale.archivals) == 2
    rotation.run(day(3))  # another run does it first
    report = stale.apply()
    assert report.created == [] and report.archived == [] and report.failed == []
    assert PartitionArchivalJob.objects.using("default").count() == 2  # not archived twice


def test_make_ahead_plans_only_the_current_and_premade_bins(partitioned) -> None:
    rotation = PartitionRotation(PartitionPolicy(retention=dt.timedelta(days=1)), tables=ONLY_TOKENS,
                                 progress=lambda _: None)
    rotation.run(day(0))
    insert_tokens(day(40), 3)  # stranded: the full rotation would drain it, make-ahead leaves it
    assert day(40) in [c.bounds.start for c in rotation.plan(day(5)).creations]
    plan = rotation.plan_make_ahead(day(5))
    assert [c.bounds.start for c in plan.creations] == [day(n) for n in range(5, 10)]
    assert plan.archivals == []
    assert not rotation.plan_make_ahead(day(0)).creations
