"""Fixtures shared by the Django tests. They talk to the real PostgreSQL, replica and Redis."""
from __future__ import annotations

import fcntl
import subprocess
import sys
from contextvars import ContextVar
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.db.backends.postgresql.operations import DatabaseOperations as PostgresOperations
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from metadata.models import Tenant, TenantMembership
from metadata.replicas import lsn


SEED_SCHEMA = "test_seed"
_seeded_tables: dict[str, list[str]] = {}  # database alias -> tables with rows right after migrate


def _flush_by_delete(truncating_sql_flush):
    """Django's flush (after every transactional test) as DELETEs in one transaction, not TRUNCATE,
    and the rows migrations wrote put back.

    TRUNCATE gives every table and index a new file: ~2 s a test here, most of a transactional
    test's time. Each TRUNCATE also takes an ACCESS EXCLUSIVE lock that the replica must take
    to replay it, so the replica's replay (one process for every database of the server) waits
    behind any replica reader of that table, up to max_standby_streaming_delay. A DELETE of the
    few rows a test left takes milliseconds and needs no such lock. Foreign keys are deferred
    (Django declares them DEFERRABLE), so the order of the tables does not matter.

    Rows written by migrations (beat jobs, permissions, content types) are restored from the copy
    ``django_db_setup`` took after migrate: in one process pytest-django runs every transactional test
    after the others, but an xdist worker runs whole files in turn, and a test that reads a
    migration's rows ran after another file's flush had removed them."""

    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        if reset_sequences or not tables:
            return truncating_sql_flush(self, style, tables, reset_sequences=reset_sequences,
                                        allow_cascade=allow_cascade)
        seeded = [table for table in _seeded_tables.get(self.connection.alias, []) if table in tables]
        return ["SET CONSTRAINTS ALL DEFERRED",
                *(f"DELETE FROM {self.quote_name(table)}" for table in tables),
                *(f"INSERT INTO {self.quote_name(table)} SELECT * FROM {SEED_SCHEMA}.{self.quote_name(table)}"
                  for table in seeded)]

    return sql_flush


PostgresOperations.sql_flush = _flush_by_delete(PostgresOperations.sql_flush)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker) -> None:
    """pytest-django's test databases, then the seed copy: every table that has rows right after
    migrate, copied to a schema of its own (out of sight of the tests' catalog queries) for the
    flush to restore."""
    from django.db import connection

    with django_db_blocker.unblock(), connection.cursor() as cursor:
        tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
        cursor.execute(f"DROP SCHEMA IF EXISTS {SEED_SCHEMA} CASCADE")
        cursor.execute(f"CREATE SCHEMA {SEED_SCHEMA}")
        seeded = []
        for table in sorted(tables):
            quoted = connection.ops.quote_name(table)
            cursor.execute(f"SELECT EXISTS (SELECT 1 FROM {quoted})")
            if cursor.fetchone()[0]:
                cursor.execute(f"CREATE TABLE {SEED_SCHEMA}.{quoted} AS TABLE {quoted}")
                seeded.append(table)
    _seeded_tables[connection.alias] = seeded


@pytest.fixture(autouse=True)
def reads_on_the_primary_unless_the_test_uses_every_database(request):
    """A test that did not ask for the replica aliases reads from the primary only.

    The router sends reads to a replica when it has replayed the caller's writes; Django refuses
    queries to aliases a test did not declare, and a plain (transaction-wrapped) test's rows never
    reach a replica anyway. Tests of the read path declare ``databases="__all__"``.
    """
    marker = request.node.get_closest_marker("django_db")
    if marker and marker.kwargs.get("databases") == "__all__":
        yield
        return
    # Threads a test starts begin with a fresh context, so ``lsn.primary_only()`` set here would not
    # reach them (a threaded request then read a token from the replica, which Django refuses in such
    # a test); a switch whose default is "primary" reaches every thread of the test.
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setattr(lsn, "_force_primary", ContextVar("specops_force_primary_in_tests", default=True))
    yield


@pytest.fixture(autouse=True)
def no_prediction_cache_from_earlier_tests():
    """Test databases reuse ids, so a deterministic request of one test could be answered from a
    prediction another test (or an earlier run) cached in the tests' Redis db; start without any."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        keys = list(client.scan_iter("specops:pred:*", count=1000))
        if keys:
            client.delete(*keys)
    except redis.RedisError:
        pass  # tests of a Redis outage run without it
    finally:
        client.close()
    yield


@pytest.fixture
def tenant(db) -> Tenant:
    return Tenant.objects.create(name="acme")


@pytest.fixture
def api_user(tenant):
    user = get_user_model().objects.create_user("alice", password="pw-alice-123")
    TenantMembership.objects.create(user=user, tenant=tenant)
    return user


@pytest.fixture
def api_client(api_user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=api_user).key}")
    return client


@pytest.fixture(scope="session")
def tiny_model_dirs():
    """A tiny random GPT-2 target/draft pair with a real tokenizer, built once (seconds).

    The xdist workers of a run share SPECOPS_MODEL_DIR: the first builds under an exclusive lock,
    the others then find the pair complete (a second build would replace a directory that a
    worker process of another test may be loading)."""
    from django.conf import settings

    from inference.demo.tiny_models import build_tiny_pair

    model_dir = Path(settings.SPECOPS_MODEL_DIR)
    model_dir.mkdir(parents=True, exist_ok=True)
    with open(model_dir / ".tiny-models.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_tiny_pair(model_dir, arch="gpt2", seed=0)


@pytest.fixture(scope="session")
def amqp_url(django_db_setup):
    """A RabbitMQ vhost of this test process's own (named after its test database), so a worker
    started here never takes another run's or another xdist worker's tasks from the same queue
    name; removed at the end."""
    from django.db import connection

    vhost = f"specops-{connection.settings_dict['NAME']}"
    rabbitmqctl("add_vhost", vhost, allowed_error="already exists")
    rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    yield f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
    rabbitmqctl("delete_vhost", vhost)


def rabbitmqctl(*args: str, allowed_error: str = "") -> None:
    out = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 or (allowed_error and allowed_error in out.stderr + out.stdout), \
        f"rabbitmqctl {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}"


@pytest.fixture
def tiny_model(db, tiny_model_dirs):
    """The tiny pair registered and promoted as model 'tiny' (the active target)."""
    from inference.registry import register_pair

    target_dir, draft_dir = tiny_model_dirs
    return register_pair("tiny", "1", target_dir, draft_dir)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a test marked ``slow`` first (in their collected order, after pytest-django's
    ordering): ``make test`` hands whole files to its xdist workers in this order, and a long file
    started last kept one worker busy minutes after the others had finished."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def pytest_unconfigure(config):
    """The test database is dropped by now: rows the request log still holds would fail to insert at
    exit (a warning on a closed stream). Nothing reads them after the last test."""
    request_log = sys.modules.get("metadata.request_log.middleware")  # imported only if a test used it
    if request_log is not None:
        request_log.writer.drop_pending()
