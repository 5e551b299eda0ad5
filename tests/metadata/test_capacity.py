"""The capacity plan derives from the snapshots, the metadata tables and pg_catalog: known snapshots in,
known averages, peaks and needs out; and ``manage.py capacity`` refuses bad options in one line."""
from __future__ import annotations

import datetime as dt
import io
import uuid

import pytest
from django.core.management import CommandError, ManagementUtility, call_command
from django.utils import timezone

from metadata.models import ModelVersion
from metadata.insights import capacity_plan
from metadata.models import Session, StatementSnapshot, TokenKind, TokenRecord
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
MINUTE = dt.timedelta(seconds=60)


def snapshot(database: str, taken_at: dt.datetime, queryid: int, family: str, calls: int, ms: float,
             read: int = 0, written: int = 0) -> StatementSnapshot:
    return StatementSnapshot(
        taken_at=taken_at, interval_s=60.0, database=database, queryid=queryid, query=f"{family} ...",
        family=family, calls=calls, total_time_ms=ms, max_time_ms=ms / calls, rows=calls, shared_blks_hit=0,
        shared_blks_read=read, shared_blks_dirtied=0, shared_blks_written=written)


@pytest.fixture
def known_load(db, settings, tenant):
    """Three 60 s intervals on the primary, one on the replica; 120 tokens; 3 sessions."""
    settings.SPECOPS_CAPACITY_DB_CORES = 2
    settings.SPECOPS_CAPACITY_DEVICE_TOKENS_PER_S = 0.5
    settings.SPECOPS_CAPACITY_DISK_FREE_BYTES = 10 * 2**30
    now = timezone.now().replace(microsecond=0)
    i1, i2, i3 = now - 3 * MINUTE, now - 2 * MINUTE, now - MINUTE
    StatementSnapshot.objects.bulk_create([
        snapshot("default", i1, 1, "select metadata_session", 500, 3000, read=600),
        snapshot("default", i1, 2, "insert metadata_token", 100, 3000),
        # Two statements of one family in one interval: the family's rate is their sum.
        snapshot("default", i2, 1, "select metadata_session", 700, 16800, read=5400),
        snapshot("default", i2, 3, "select metadata_session", 300, 7200),
        snapshot("default", i2, 2, "insert metadata_token", 200, 6000, written=600),
        snapshot("default", i3, 1, "select metadata_session", 300, 3000),
        snapshot("replica_0", i2, 1, "select metadata_session", 600, 12000),
    ])
    minute = (now - dt.timedelta(minutes=40)).replace(second=0)  # 60 s buckets start on the minute
    session_id = uuid.uuid4()
    TokenRecord.objects.bulk_create(
        [TokenRecord(session_id=session_id, session_created_at=minute + dt.timedelta(seconds=5),
                     position=p, step=p, token_id=p, piece="x", kind=TokenKind.TARGET) for p in range(90)]
        + [TokenRecord(session_id=session_id, session_created_at=minute + dt.timedelta(minutes=10, seconds=5),
                       position=p, step=p, token_id=p, piece="x", kind=TokenKind.TARGET) for p in range(90, 120)])
    model = ModelVersion.objects.create(name="cap", version="1", role="target", path="/nowhere", context_length=64)
    for _ in range(3):
        Session.objects.create(tenant=tenant, target=model, drafter="none", queue="cpu", prompt="x", prompt_tokens=1,
                               created_at=minute + dt.timedelta(minutes=20, seconds=1))
    return now


@pytest.mark.django_db(databases="__all__")
def test_the_plan_is_the_observed_peak_times_the_buffer(known_load):
    plan = capacity_plan(hours=1, buffer=2.5, now=known_load)
    primary, replica = plan.databases
    assert (primary.database, replica.database) == ("default", "replica_0")
    assert primary.snapshots == 3 and primary.covered_s == pytest.approx(180)
    assert primary.statements.average == pytest.approx(2100 / 180)
    assert primary.statements.peak == pytest.approx(20) and primary.statements.peak_at == known_load - 2 * MINUTE
    assert primary.busy.peak == pytest.approx(0.5) and primary.read_busy.peak == pytest.approx(0.4)
    assert primary.iops.peak == pytest.approx(100) and primary.iops.average == pytest.approx(6600 / 180)
    families = dict(primary.families)
    assert families["select metadata_session"].peak == pytest.approx(1000 / 60)
    assert families["select metadata_session"].average == pytest.approx(1800 / 180)
    assert families["insert metadata_token"].peak == pytest.approx(200 / 60)
    assert plan.tokens.peak == pytest.approx(90 / 60) and plan.tokens.average == pytest.approx(120 / 3600)
    assert plan.sessions.peak == pytest.approx(3 / 60)

    needs = plan.needs
    pools = {p.database: p for p in needs.pools}
    assert pools["default"].connections == 2  # ceil(0.5 busy x 2.5)
    assert pools["replica_0"].connections == 1  # ceil(0.2 x 2.5)
    assert pools["default"].max_connections and pools["default"].pool_max_size
    assert needs.read_cores == pytest.approx((0.4 + 0.2) * 2.5) and needs.replicas == 1  # 1.5 cores over 2
    assert needs.primary_cores == pytest.approx(0.1 * 2.5)
    assert needs.worker_devices == 8  # ceil(1.5 tokens/s x 2.5 / 0.5 per device)
    assert needs.iops == pytest.approx(250)
    growth = plan.storage.bytes_per_day
    assert plan.storage.free_bytes == 10 * 2**30
    assert {t.table for t in plan.storage.tables} >= {"metadata_token", "metadata_statement_snapshot"}
    if growth:
        assert needs.days_until_full == pytest.approx(10 * 2**30 / growth)
        assert needs.days_until_full_buffered == pytest.approx(needs.days_until_full / 2.5)

    more = capacity_plan(hours=1, buffer=3, now=known_load)
    assert more.needs.worker_devices == 9 and more.needs.pools[0].connections == 2  # ceil(1.5), ceil(4.5 / 0.5)


@pytest.mark.django_db(databases="__all__")
def test_the_command_prints_the_plan(known_load):
    out = io.StringIO()
    call_command("capacity", "--hours", "1", "--buffer", "2.5", stdout=out)
    text = out.getvalue()
    assert "buffer 2.5x over the observed peak" in text
    assert "default: 3 snapshots over 0.05 h; statements/s 11.7 average, 20.0 peak" in text
    assert "select metadata_session: 10.00/s average, 16.67/s peak" in text
    assert "default: 2 server connections busy at once" in text
    assert "replicas: 1 for reads" in text and "IOPS: 250" in text


def test_bad_options_are_one_line_errors(capsys):
    for args, words in ((["--buffer", "0.5"], "--buffer must be between 1 and 100, got 0.5"),
                        (["--bucket-seconds", "1.5"], "--bucket-seconds must be an integer, got '1.5'"),
                        (["--bogus"], "unrecognized arguments: --bogus")):
        with pytest.raises(CommandError, match=words):
            call_command("capacity", *args)
    # From the command line: one line on stderr, exit status 1.
    with pytest.raises(SystemExit) as exited:
        ManagementUtility(["manage.py", "capacity", "--hours", "abc"]).execute()
    assert exited.value.code == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "CommandError" in line]
    assert errors == ["CommandError: capacity: --hours must be a number, got 'abc'"]
