"""The partitioned sessions table: UUIDv7 ids that carry their partition, lookups that prune to
one partition, a day archived and restored with its tokens and candidates, 410 for an archived id."""
from __future__ import annotations

import datetime as dt
import re
import uuid

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from metadata.archival import PartitionArchiver
from metadata.archival.families import SESSION_FAMILY, archived_days, archived_session_job, day_of, restore_day
from metadata.ids import created_at_of, is_uuid7, to_millisecond, uuid7
from metadata.models import (
    ArchivalStep,
    PartitionArchivalJob,
    Session,
    SessionStatus,
    Tenant,
    TenantMembership,
)
from metadata.partitions import PartitionPolicy, PartitionRotation, catalog
from sessions.state.cache import _STATE_SQL_PRUNED
from tests.metadata.partition_helpers import day, insert_tokens, row_count

FAMILY = {table: "created_at" if table == "metadata_session" else "session_created_at" for table in SESSION_FAMILY}
KEEP_ALL = PartitionPolicy(retention=dt.timedelta(days=1000))
KEEP_ONE_DAY = PartitionPolicy(retention=dt.timedelta(days=1))
PARTITION_NAME = re.compile(r"metadata_session_(p\d{8}|default)\b")


# ---------------------------------------------------------------------- ids (plain Python)
def test_a_uuid7_carries_its_millisecond_and_version() -> None:
    moment = dt.datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=dt.timezone.utc)
    ident = uuid7(moment)
    assert ident.version == 7 and ident.variant == uuid.RFC_4122 and is_uuid7(ident) and is_uuid7(str(ident))
    assert created_at_of(ident) == moment.replace(microsecond=123000) == to_millisecond(moment)
    assert uuid7(moment) != ident  # random bits: two ids of one millisecond differ
    ids = [uuid7(moment + dt.timedelta(milliseconds=n)) for n in (3, 1, 2)]
    assert sorted(ids) == sorted(ids, key=created_at_of)  # time-ordered: index locality of new rows
    assert created_at_of(uuid.uuid4()) is None and not is_uuid7(uuid.uuid4()) and created_at_of("no") is None
    with pytest.raises(ValueError, match="timezone-aware"):
        uuid7(dt.datetime(2031, 1, 1))


def test_a_new_session_gets_an_id_of_its_creation_time() -> None:
    fresh = Session(prompt="p")
    assert is_uuid7(fresh.id) and created_at_of(fresh.id) == fresh.created_at
    old = dt.datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=dt.timezone.utc)
    dated = Session(prompt="p", created_at=old)
    assert dated.created_at == to_millisecond(old) and created_at_of(dated.id) == dated.created_at
    given = uuid7(old)
    assert Session(id=given, prompt="p").created_at == created_at_of(given)
    legacy = uuid.uuid4()
    assert Session(id=legacy, prompt="p", created_at=old).created_at == old  # a version-4 id keeps its time
    with pytest.raises(ValueError, match="carries its creation time"):
        Session(id=given, prompt="p", created_at=old + dt.timedelta(seconds=1))


# ---------------------------------------------------------------------- the table
def make_session(tenant: Tenant, model_version, when: dt.datetime | None = None, **fields) -> Session:
    fields.setdefault("status", SessionStatus.SUCCEEDED)
    if when is not None:
        fields["created_at"] = when
    return Session.objects.create(tenant=tenant, target=model_version, drafter="none", queue="cpu", prompt="p",
                                  prompt_tokens=1, **fields)


def partitions_in(plan: str) -> set[str]:
    return set(PARTITION_NAME.findall(plan))


@pytest.fixture
def week(partitioned, model_version) -> list[Session]:
    """Sessions on each of seven days, in seven daily partitions (made by the real rotation)."""
    PartitionRotation(KEEP_ALL, tables=FAMILY, progress=lambda _: None).run(day(1))  # day 1 and 4 ahead
    PartitionRotation(KEEP_ALL, tables=FAMILY, progress=lambda _: None).run(day(3))  # up to day 7
    tenant = Tenant.objects.create(name="week")
    sessions = [make_session(tenant, model_version, day(n, hour=5)) for n in range(1, 8)]
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE metadata_session")
    return sessions


def test_the_sessions_table_is_partitioned_with_its_indexes_on_every_partition(week) -> None:
    assert catalog.is_partitioned("metadata_session")
    assert len(catalog.range_partitions("metadata_session")) >= 7
    with connection.cursor() as cursor:
        cursor.execute("SELECT c.relname, array_agg(pg_get_indexdef(i.indexrelid) ORDER BY 1) FROM pg_inherits h "
                       "JOIN pg_class c ON c.oid = h.inhrelid JOIN pg_index i ON i.indrelid = c.oid "
                       "WHERE h.inhparent = 'metadata_session'::regclass GROUP BY 1")
        indexes = dict(cursor.fetchall())
        # Built on the standalone table before its ATTACH (named by the maker), then attached.
        cursor.execute("SELECT count(*), count(*) FILTER (WHERE x.relname ~ '_ix[0-9]+$') FROM pg_inherits h "
                       "JOIN pg_class x ON x.oid = h.inhrelid WHERE h.inhparent IN ("
                       "SELECT indexrelid FROM pg_index WHERE indrelid = 'metadata_session'::regclass) "
                       "AND x.relname LIKE 'metadata\\_session\\_p%%'")
        attached, prebuilt = cursor.fetchone()
    assert attached >= 7 * 8 and prebuilt == attached, (attached, prebuilt)
    assert indexes, "no partition has an index"
    for partition, definitions in indexes.items():
        text = " ".join(definitions)
        assert "INCLUDE (status, token_count, updated_at, tenant_id)" in text, partition  # the covering state index
        assert "WHERE ((status)::text = ANY" in text, partition  # the live-sessions partial index
        assert "(tenant_id, created_at DESC, id)" in text, partition  # the tenant-recent index
        assert "(id, created_at)" in text, partition  # the primary key's part


def test_a_lookup_by_id_reads_one_partition(week) -> None:
    target = week[3]
    plan = Session.objects.filter(pk=target.pk).explain()
    assert partitions_in(plan) == {f"p{target.created_at:%Y%m%d}"}, plan
    with connection.cursor() as cursor:  # the cache loader's read of the state region
        cursor.execute("EXPLAIN " + _STATE_SQL_PRUNED, [target.pk, created_at_of(target.pk)])
        state_plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("EXPLAIN SELECT status FROM metadata_session WHERE id = %s", [target.pk])
        unpruned = "\n".join(row[0] for row in cursor.fetchall())
    assert partitions_in(state_plan) == {f"p{target.created_at:%Y%m%d}"}, state_plan
    assert len(partitions_in(unpruned)) >= 7, unpruned  # what the key saves: every partition's index
    assert Session.objects.get(pk=target.pk).created_at == target.created_at
    some = [week[1].pk, week[5].pk]
    assert partitions_in(Session.objects.filter(pk__in=some).explain()) == {
        f"p{week[1].created_at:%Y%m%d}", f"p{week[5].created_at:%Y%m%d}"}


def test_writes_by_id_carry_the_partition_key(week) -> None:
    session = week[2]
    with CaptureQueriesContext(connection) as queries:
        session.status = SessionStatus.FAILED
        session.save(update_fields=["status"])
        session.refresh_from_db()
        Session.objects.bulk_update([session], ["status"])
        Session.objects.filter(pk=session.pk).update(token_count=3)
    key = f'"created_at" = \'{session.created_at:%Y-%m-%d %H:%M:%S}'
    statements = [q["sql"] for q in queries.captured_queries if '"metadata_session"' in q["sql"]]
    assert len(statements) == 4 and all(key in sql or '"created_at" IN' in sql for sql in statements), statements
    assert Session.objects.get(pk=session.pk).token_count == 3


def test_a_version4_id_is_still_found(week, model_version) -> None:
    legacy = make_session(week[0].tenant, model_version, id=uuid.uuid4(), created_at=day(4, hour=9))
    assert Session.objects.get(pk=legacy.pk).created_at == day(4, hour=9)
    from sessions.state.cache import load_session_state
    assert load_session_state(str(legacy.pk)).value["status"] == SessionStatus.SUCCEEDED


# ---------------------------------------------------------------------- archived with its tokens
def insert_candidates_of(session: Session, count: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO metadata_candidate (session_id, session_created_at, step, branch, token_ids, score, "
            "accepted_len) SELECT %s, %s, g, 0, jsonb_build_array(g), g / 10.0, 1 FROM generate_series(0, %s - 1) g",
            [session.pk, session.created_at, count])


@pytest.fixture
def archived_day_one(partitioned, model_version):
    """Day 1's sessions (with tokens and candidates) archived by a rotation; day 2 kept."""
    PartitionRotation(KEEP_ALL, tables=FAMILY, progress=lambda _: None).run(day(1))
    tenant = Tenant.objects.create(name="old")
    gone = make_session(tenant, model_version, day(1, hour=3))
    kept = make_session(tenant, model_version, day(2, hour=3))
    for session in (gone, kept):
        insert_tokens(session.created_at, 40, session_id=session.pk)
        insert_candidates_of(session, 12)
    PartitionRotation(KEEP_ONE_DAY, tables=FAMILY, progress=lambda _: None).run(day(3, hour=1))
    return tenant, gone, kept


def test_a_day_is_archived_as_one_unit_and_restored_whole(archived_day_one) -> None:
    tenant, gone, kept = archived_day_one
    assert not Session.objects.filter(pk=gone.pk).exists() and Session.objects.filter(pk=kept.pk).exists()
    jobs = PartitionArchivalJob.objects.filter(step=ArchivalStep.DROPPED)
    days = archived_days(jobs)
    assert len(days) == 1 and days[0].complete and days[0].bounds.start == day(1)
    assert {t: j.row_count for t, j in days[0].jobs.items()} == {
        "metadata_session": 1, "metadata_token": 40, "metadata_candidate": 12}
    assert archived_session_job(gone.pk).partition == days[0].jobs["metadata_session"].partition
    assert archived_session_job(kept.pk) is None

    day_one = day_of(days[0].jobs["metadata_token"])
    assert [j.parent_table for j in day_one.ordered_jobs()] == list(SESSION_FAMILY)
    results = restore_day(day_one, attach=True, progress=lambda _: None)
    assert [r.rows for r in results] == [1, 40, 12]
    restored = Session.objects.get(pk=gone.pk)
    assert restored.tenant_id == tenant.pk and archived_session_job(gone.pk) is None
    assert row_count("metadata_token") == 80 and row_count("metadata_candidate") == 24


def test_a_partition_with_live_sessions_is_not_archived(partitioned, model_version) -> None:
    PartitionRotation(KEEP_ALL, tables=FAMILY, progress=lambda _: None).run(day(1))
    tenant = Tenant.objects.create(name="live")
    running = make_session(tenant, model_version, day(1, hour=2), status=SessionStatus.RUNNING)
    PartitionRotation(KEEP_ONE_DAY, tables={"metadata_session": "created_at"},
                      progress=lambda _: None).run(day(3, hour=1))
    job = PartitionArchivalJob.objects.get(parent_table="metadata_session", partition=f"metadata_session_p{day(1):%Y%m%d}")
    assert job.step == ArchivalStep.FAILED and "1 live session" in job.error
    assert Session.objects.get(pk=running.pk).status == SessionStatus.RUNNING  # still there, still attached
    Session.objects.filter(pk=running.pk).update(status=SessionStatus.SUCCEEDED)
    PartitionArchiver(progress=lambda _: None).archive(job)
    job.refresh_from_db()
    assert job.step == ArchivalStep.DROPPED and job.row_count == 1


def test_an_archived_session_answers_410_and_staff_see_the_archive(archived_day_one) -> None:
    tenant, gone, kept = archived_day_one
    user = get_user_model().objects.create_user("ops", password="pw-ops-12345")
    TenantMembership.objects.create(user=user, tenant=tenant)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")

    response = client.get(f"/api/v1/sessions/{gone.pk}/")
    assert response.status_code == 410, response.content
    assert "archived" in response.json()["detail"] and "archive" not in response.json()
    assert client.get(f"/api/v1/sessions/{gone.pk}/tokens/").status_code == 410
    assert client.get(f"/api/v1/sessions/{kept.pk}/").status_code == 200
    assert client.get(f"/api/v1/sessions/{uuid7(day(2, hour=4))}/").status_code == 404  # a day still here
    assert client.get(f"/api/v1/sessions/{uuid.uuid4()}/").status_code == 404

    user.is_staff = True
    user.save()
    body = client.get(f"/api/v1/sessions/{gone.pk}/").json()
    job = archived_session_job(gone.pk)
    assert body["archive"] == job.archive_path and body["archival_job"] == str(job.pk) and body["status"] == 410
