"""database_retry: a worker's statement whose connection PostgreSQL cut (a restart, a network
blip) is tried again on a new connection, within its window; other errors are not retried."""
from __future__ import annotations

import logging
import time

import psycopg
import pytest
from django.db import IntegrityError, OperationalError, connection

from sessions.runs import database_retry
from metadata.models import Tenant

pytestmark = pytest.mark.django_db(transaction=True)  # the test's own connection is cut: no wrapping transaction


@pytest.fixture(autouse=True)
def fresh_connection_after():
    """A test leaves its connection cut: the next statement (the test's teardown) gets a new one."""
    yield
    connection.close()


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def cut(pid: int) -> None:
    """Terminate a backend from a connection of its own, as a fast shutdown of PostgreSQL does."""
    params = connection.get_connection_params()
    with psycopg.connect(dbname=params["dbname"], host=params.get("host"), port=params.get("port"),
                         user=params.get("user"), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])


def count_tenants_after_a_cut(pids: list[int]):
    """A read whose first try runs on a connection cut under it."""
    def read() -> int:
        pid = backend_pid()
        pids.append(pid)
        if len(pids) == 1:
            cut(pid)
        return Tenant.objects.count()
    return read


def test_a_read_on_a_cut_connection_fails_without_the_retry():
    pids: list[int] = []
    with pytest.raises(OperationalError):
        count_tenants_after_a_cut(pids)()


def test_a_statement_on_a_cut_connection_is_tried_again_on_a_new_one(caplog):
    Tenant.objects.create(name="acme")
    pids: list[int] = []
    with caplog.at_level(logging.WARNING, logger="sessions.runs.database_retry"):
        assert database_retry.retrying(count_tenants_after_a_cut(pids), "counting tenants") == 1
    assert len(pids) == 2 and pids[0] != pids[1]  # the second try ran on another backend
    assert "counting tenants failed (OperationalError" in caplog.text


def test_an_error_that_is_not_the_connection_is_raised_at_once():
    Tenant.objects.create(name="acme")
    tries: list[int] = []

    def duplicate() -> None:
        tries.append(1)
        Tenant.objects.create(name="acme")

    with pytest.raises(IntegrityError):
        database_retry.retrying(duplicate, "a duplicate tenant")
    assert len(tries) == 1


def test_the_window_closes_with_the_last_error(settings, monkeypatch):
    settings.SPECOPS_SESSION_LEASE_S = 0.2
    monkeypatch.setattr(database_retry, "RETRY_FOR_AT_LEAST_S", 1.2)
    tries: list[int] = []

    def always_cut() -> int:
        tries.append(1)
        cut(backend_pid())
        return Tenant.objects.count()

    started = time.monotonic()
    with pytest.raises(OperationalError):
        database_retry.retrying(always_cut, "a read that never gets through")
    # tried every 0.5 s within 1.2 s (two or three tries, as fast as each cut is), then the last
    # error raised once no try fits in the window
    elapsed = time.monotonic() - started
    assert 2 <= len(tries) <= 3 and 0.5 <= elapsed < 1.2 + 2.0, (len(tries), elapsed)
