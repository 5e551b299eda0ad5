"""The recent-activity partial index: literal cutoff, rotated concurrently, used by the planner."""
from __future__ import annotations

import datetime as dt

import pytest
from django.db import ProgrammingError, connection

from metadata.models import Session, SessionStatus, Tenant
from metadata.partitions import (
    RecentIndexPolicy,
    existing_indexes,
    recent_sessions,
    rotate_recent_index,
)

NOW = dt.datetime(2030, 6, 1, 12, 0, tzinfo=dt.timezone.utc)
POLICY = RecentIndexPolicy(window=dt.timedelta(minutes=30), rotate_every=dt.timedelta(minutes=10))


@pytest.fixture
def sessions(partitioned, model_version) -> int:
    """3000 sessions active over ten days, 25 of them in the last 30 minutes; analyzed."""
    tenant = Tenant.objects.create(name="load")
    rows = []
    for n in range(3000):
        active = NOW - (dt.timedelta(minutes=n) if n < 25 else dt.timedelta(hours=1, minutes=5 * n))
        rows.append(Session(tenant=tenant, target=model_version, drafter="ngram", queue="cpu", prompt="p",
                            prompt_tokens=1, status=SessionStatus.SUCCEEDED, last_activity_at=active))
    Session.objects.bulk_create(rows, batch_size=1000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE metadata_session")
    return 25


def plan_of_recent_query() -> str:
    return recent_sessions(30, now=NOW).using("default").only("id").explain()


def test_the_planner_uses_the_partial_index_for_the_last_30_minutes(sessions) -> None:
    assert "session_recent_activity_" not in plan_of_recent_query()  # baseline: nothing to use
    name = rotate_recent_index(NOW, POLICY)
    plan = plan_of_recent_query()
    assert name in plan, plan
    assert recent_sessions(30, now=NOW).using("default").count() == sessions


def test_the_index_predicate_is_a_literal_cutoff_not_now(sessions) -> None:
    name = rotate_recent_index(NOW, POLICY)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_get_expr(indpred, indrelid) FROM pg_index WHERE indexrelid = to_regclass(%s)", [name])
        predicate = cursor.fetchone()[0]
    assert "now()" not in predicate and "2030-06-01 11:10:00+00" in predicate  # 30 + 2 x 10 minutes back
    with pytest.raises(ProgrammingError, match="IMMUTABLE"):  # why the literal: PostgreSQL refuses now()
        with connection.cursor() as cursor:
            cursor.execute("CREATE INDEX refused ON metadata_session (last_activity_at) "
                           "WHERE last_activity_at > now() - interval '30 minutes'")


def test_rotation_is_idempotent_and_replaces_the_old_index(sessions) -> None:
    first = rotate_recent_index(NOW, POLICY)
    assert rotate_recent_index(NOW + dt.timedelta(minutes=5), POLICY) == first  # still fresh: kept
    later = NOW + dt.timedelta(minutes=25)
    second = rotate_recent_index(later, POLICY)
    assert second != first
    assert [i.name for i in existing_indexes()] == [second]  # the old one was dropped
    assert second in recent_sessions(30, now=later).using("default").only("id").explain()


def test_an_invalid_leftover_of_a_crashed_build_is_dropped(sessions) -> None:
    leftover = "session_recent_activity_203001010000"
    with connection.cursor() as cursor:  # a crashed build: the parent's index made, no partition's attached
        cursor.execute(f"CREATE INDEX {leftover} ON ONLY metadata_session (status)")
    assert [(i.name, i.valid) for i in existing_indexes()] == [(leftover, False)]
    name = rotate_recent_index(NOW, POLICY)
    assert [(i.name, i.valid) for i in existing_indexes()] == [(name, True)]
