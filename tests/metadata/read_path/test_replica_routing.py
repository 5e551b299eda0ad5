"""Routing on the real streaming replica: read-your-writes through the API while replay is
paused, back to the replica after resume, no errors while the replica is stopped."""
from __future__ import annotations

import pytest
from django.db import connections
from prometheus_client import REGISTRY

from metadata.models import Session, SessionStatus
from metadata.replicas import ReplicaRouter, lsn, read_routed, replica_health, route_read
from tests.metadata.read_path.conftest import (
    make_session,
    paused_replay,
    replica_alias,
    served_by,
    stopped_replica,
    wait_for_replica_catch_up,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")
SESSIONS = "/api/v1/sessions/"


def listed_ids(response) -> set[str]:
    return {row["id"] for row in response.json()["results"]}


def test_lsn_text_round_trip():
    assert lsn.parse_lsn("16/B374D848") == (0x16 << 32) | 0xB374D848
    assert lsn.format_lsn(lsn.parse_lsn("0/3000060")) == "0/3000060"
    with pytest.raises(ValueError):
        lsn.parse_lsn("3000060")


def test_read_without_prior_write_goes_to_replica(api_client, tenant, target_version):
    session = make_session(tenant, target_version)
    wait_for_replica_catch_up()

    response = api_client.get(SESSIONS)

    assert response.status_code == 200
    assert served_by(response) == [replica_alias()]  # auth, tenant and list: all on the replica
    assert str(session.pk) in listed_ids(response)
    assert lsn.LSN_HEADER not in response  # nothing written, no floor handed out


def test_writes_and_reads_in_atomic_go_to_primary(tenant, target_version):
    router = ReplicaRouter()
    wait_for_replica_catch_up()
    with lsn.floor_scope():
        assert router.db_for_write(Session) == "default"
        assert router.db_for_read(Session) == replica_alias()
        from django.db import transaction

        with transaction.atomic():
            assert router.db_for_read(Session) == "default"


def test_login_sessions_are_read_on_the_primary_even_from_a_caught_up_replica():
    """A sign-in's redirect carries no LSN floor: its login session must not be looked up on a
    replica that may not have replayed it (the admin then sent its user back to the sign-in)."""
    from django.contrib.sessions.models import Session as LoginSession

    wait_for_replica_catch_up()
    with lsn.floor_scope():
        assert ReplicaRouter().db_for_read(Session) == replica_alias()
        assert ReplicaRouter().db_for_read(LoginSession) == "default"


def test_paused_replica_serves_own_writes_from_primary_then_replica_after_resume(own_replica, api_client,
                                                                                   target_version):
    wait_for_replica_catch_up()
    with paused_replay():
        created = api_client.post("/api/v1/generations/", {"prompt": "hello speculative world"}, format="json")
        assert created.status_code == 202, created.content
        session_id = str(created.data["id"])
        floor = created[lsn.LSN_HEADER]
        assert lsn.parse_lsn(floor) > replica_replay_position()

        # The client sends its floor back: its reads see its write, served by the primary.
        detail = api_client.get(f"{SESSIONS}{session_id}/", HTTP_X_SPECOPS_LSN=floor)
        listing = api_client.get(SESSIONS, HTTP_X_SPECOPS_LSN=floor)
        assert detail.status_code == 200 and detail.json()["status"] == SessionStatus.QUEUED
        assert "default" in served_by(detail) and replica_alias() not in served_by(detail)
        assert session_id in listed_ids(listing)
        assert served_by(listing) == ["default"]

        # Without the floor the same list is read from the paused replica, which lacks the row:
        # proof that the replica really was behind.
        stale = api_client.get(SESSIONS)
        assert served_by(stale) == [replica_alias()]
        assert session_id not in listed_ids(stale)
        assert lag_bytes() > 0

    # Replay resumed: within a probe interval or two the same client reads from the replica again.
    def listed_from_replica() -> bool:
        response = api_client.get(SESSIONS, HTTP_X_SPECOPS_LSN=floor)
        return served_by(response) == [replica_alias()] and session_id in listed_ids(response)

    assert wait_until(listed_from_replica, 15, 0.1)


def test_stopped_replica_reads_succeed_from_primary(own_replica, api_client, tenant, target_version, monkeypatch):
    session = make_session(tenant, target_version)
    wait_for_replica_catch_up()
    warm_replica_pool(api_client)
    monkeypatch.setattr(replica_health(), "ttl_s", 10.0)  # keep the pre-stop snapshot: a mid-read failure
    statuses: list[int] = []
    with stopped_replica():
        # First read: the snapshot still says "up", the query fails mid-read and is retried.
        first = api_client.get(SESSIONS)
        statuses.append(first.status_code)
        assert str(session.pk) in listed_ids(first)
        assert served_by(first)[-1] == "default"
        # Then the replica is skipped before any query is sent.
        for _ in range(5):
            response = api_client.get(SESSIONS)
            statuses.append(response.status_code)
            assert served_by(response) == ["default"]
        replica_health().expire()  # a fresh probe finds it down
        probed = api_client.get(f"{SESSIONS}{session.pk}/")
        statuses.append(probed.status_code)
        assert not replica_health().usable(replica_health().snapshot().replicas[0])
    assert statuses == [200] * len(statuses)


def test_replica_connection_lost_mid_request_is_retried_on_primary(api_client, tenant, target_version,
                                                                  monkeypatch):
    session = make_session(tenant, target_version)
    wait_for_replica_catch_up()
    warm_replica_pool(api_client)
    monkeypatch.setattr(replica_health(), "ttl_s", 10.0)  # the snapshot keeps saying "up"
    terminate_replica_backends()  # the replica stays up, the pooled connections are dead

    response = api_client.get(SESSIONS)

    assert response.status_code == 200
    assert served_by(response) == [replica_alias(), "default"]  # chosen, failed, retried
    assert str(session.pk) in listed_ids(response)
    assert served_by(api_client.get(SESSIONS)) == ["default"]  # skipped until the next probe


def test_replica_read_error_falls_back_inside_read_routed(tenant, target_version):
    """The function form of the fallback: a read that fails on the replica runs on the primary."""
    session = make_session(tenant, target_version)
    wait_for_replica_catch_up()
    attempts: list[str] = []

    def read(alias: str) -> str:
        attempts.append(alias)
        with connections[alias].cursor() as cursor:
            if alias != "default":
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")  # the server drops us
            cursor.execute("SELECT status FROM metadata_session WHERE id = %s", [session.pk])
            return cursor.fetchone()[0]

    with lsn.floor_scope():
        status, route = read_routed(read)
    assert status == SessionStatus.QUEUED
    assert attempts == [replica_alias(), "default"] and route.alias == "default"
    assert route_read().alias == "default"  # the replica stays skipped until the next probe


def warm_replica_pool(api_client) -> None:
    """Until a request is served by the replica alone: earlier tests (a stopped replica) may have
    left dead connections in the pool, each of which costs one fallback."""
    def clean_replica_read() -> bool:
        replica_health().expire()
        return served_by(api_client.get(SESSIONS)) == [replica_alias()]

    assert wait_until(clean_replica_read, 10, 0.05)


def terminate_replica_backends() -> None:
    import psycopg
    from django.conf import settings

    config = settings.DATABASES[replica_alias()]
    with psycopg.connect(host=config["HOST"], port=config["PORT"], user=config["USER"] or "postgres",
                         dbname="postgres", autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                     [connections[replica_alias()].settings_dict["NAME"]])


def replica_replay_position() -> int:
    replica_health().expire()
    return replica_health().snapshot().replicas[0].replay_lsn


def lag_bytes() -> float:
    replica_health().expire()
    replica_health().snapshot()
    return REGISTRY.get_sample_value("specops_replica_lag_bytes", {"replica": replica_alias()}) or 0.0
