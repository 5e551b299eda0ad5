"""Fixtures of the read-path tests: a real streaming replica, paused or stopped and always
restored, plus a clean cache and a fresh replica snapshot for every test.

Tests that read through the replica are transactional (``transaction=True``): the replica only
sees committed rows, replicated through WAL into the mirrored test database. A test that pauses
or stops a replica asks for ``own_replica``: the replica alias then points at a replica of this
test process's own (tests/private_replica.py) for the test, since pausing or stopping the shared
one stalls every other test's reads on the machine.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.db import connections

from metadata.models import ModelVersion, VersionStatus
from metadata.cache import default_guard
from metadata.models import Session
from metadata.replicas import lsn, replica_health
from sessions.state import cache as session_state
from tests.private_replica import PrivateReplica

READ_PATH_MIDDLEWARE = "metadata.replicas.middleware.ReadYourWritesMiddleware"
REQUEST_LOG_MIDDLEWARE = "metadata.request_log.RequestLogMiddleware"


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def _admin_connection(alias: str) -> psycopg.Connection:
    config = settings.DATABASES[alias]
    return psycopg.connect(host=config["HOST"], port=config["PORT"], user=config["USER"] or "postgres",
                           dbname="postgres", autocommit=True, connect_timeout=3)


def replica_alias() -> str:
    return settings.DATABASE_REPLICAS[0]


def primary_insert_lsn() -> int:
    with _admin_connection("default") as conn:
        return lsn.parse_lsn(conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])


def replica_replay_lsn() -> int:
    with _admin_connection(replica_alias()) as conn:
        return lsn.parse_lsn(conn.execute("SELECT pg_last_wal_replay_lsn()::text").fetchone()[0])


def wait_for_replica_catch_up(timeout_s: float = 20.0) -> None:
    """Until the replica has replayed everything written so far; then forget the old snapshot."""
    target = primary_insert_lsn()
    assert wait_until(lambda: replica_replay_lsn() >= target, timeout_s), "replica did not catch up"
    replica_health().expire()


def _require_own_replica() -> PrivateReplica:
    assert _own is not None, "pause or stop only a replica of the test's own: ask for the own_replica fixture"
    return _own


@contextmanager
def paused_replay() -> Iterator[None]:
    _require_own_replica()
    with _admin_connection(replica_alias()) as conn:
        conn.execute("SELECT pg_wal_replay_pause()")
        try:
            assert wait_until(
                lambda: conn.execute("SELECT pg_get_wal_replay_pause_state()").fetchone()[0] == "paused", 10
            )
            replica_health().expire()
            yield
        finally:
            conn.execute("SELECT pg_wal_replay_resume()")
            replica_health().expire()


def _replica_accepts_connections() -> bool:
    try:
        replica_replay_lsn()
        return True
    except psycopg.Error:
        return False


def _forget_replica_connections() -> None:
    """Django's replica pools and the health probe's connections, so the next read connects anew:
    a pool that saw its connections die backs off before reconnecting (psycopg_pool waits >= 1 s
    after a failed attempt, longer after each), and the 1 s pool timeout would fail a read."""
    for alias in settings.DATABASE_REPLICAS:
        connections[alias].close()
        connections[alias].close_pool()
    replica_health().close()
    replica_health().expire()


@contextmanager
def stopped_replica() -> Iterator[None]:
    """Stop the test's own replica; always start it again and wait until it catches up."""
    own = _require_own_replica()
    own.stop()
    try:
        yield
    finally:
        own.start()
        _point_replica_alias_at(own.host, str(own.port))  # the port may have changed
        assert wait_until(_replica_accepts_connections, 30, 0.2), "replica did not come back"
        wait_for_replica_catch_up(30)


_own: PrivateReplica | None = None


def _point_replica_alias_at(host: str, port: str) -> None:
    """Where the replica alias connects (Django's pools and the health probe read this dict)."""
    connections[replica_alias()].settings_dict.update(HOST=host, PORT=port)
    settings.DATABASES[replica_alias()].update(HOST=host, PORT=port)
    _forget_replica_connections()


@pytest.fixture(scope="session")
def private_replica_server(django_db_setup) -> Iterator[PrivateReplica]:
    """This process's own streaming replica of the primary, built when a test first needs it."""
    primary = settings.DATABASES["default"]
    server = PrivateReplica.build(primary["HOST"] or "127.0.0.1", int(primary["PORT"]))
    yield server
    server.remove()


@pytest.fixture
def own_replica(private_replica_server) -> Iterator[PrivateReplica]:
    """For one test the replica alias (Django's pool, the health probe) is this process's own
    replica, which the test may pause or stop; the shared replica is untouched."""
    global _own
    config = connections[replica_alias()].settings_dict
    shared = (config["HOST"], config["PORT"])
    if not private_replica_server.accepts_connections():
        private_replica_server.start()
    _point_replica_alias_at(private_replica_server.host, str(private_replica_server.port))
    _own = private_replica_server
    try:
        yield private_replica_server
    finally:
        _own = None
        _point_replica_alias_at(*shared)


@pytest.fixture(autouse=True)
def read_path_state(settings) -> Iterator[None]:
    """Each test: the read-path middleware present, a fresh floor, empty caches, a new probe."""
    if READ_PATH_MIDDLEWARE not in settings.MIDDLEWARE:  # until specops/settings.py lists it
        middleware = list(settings.MIDDLEWARE)
        anchor = middleware.index(REQUEST_LOG_MIDDLEWARE) + 1 if REQUEST_LOG_MIDDLEWARE in middleware else 1
        middleware.insert(anchor, READ_PATH_MIDDLEWARE)
        settings.MIDDLEWARE = middleware
    settings.SPECOPS_EXPOSE_READ_DB = True
    default_guard().run(lambda client: client.flushdb())  # the tests' own Redis db (scripts/test.sh REDIS_URL)
    for cache in session_state._caches.values():
        cache.clear_local()
    replica_health().expire()
    with lsn.floor_scope():
        yield
    for cache in session_state._caches.values():
        cache.clear_local()


@pytest.fixture
def target_version(db, tmp_path: Path) -> ModelVersion:
    """An active target whose directory holds a tiny word-level tokenizer (for POST validation),
    a config and a weights file: no worker runs here, so nothing loads them, but a version whose
    files are missing is refused with a 503 (inference.version_files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate("hello world speculative decoding".split())}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"})
    )
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": len(vocab)}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return ModelVersion.objects.create(name="m", version="1", role="target", path=str(tmp_path),
                                       context_length=512, status=VersionStatus.ACTIVE)


def make_session(tenant, target: ModelVersion, **fields) -> Session:
    values = {"drafter": "ngram", "queue": "cpu", "prompt": "hello world", "prompt_tokens": 2,
              "params": {"max_new_tokens": 8, "temperature": 0.0}} | fields
    return Session.objects.create(tenant=tenant, target=target, **values)


def served_by(response) -> list[str]:
    return response[lsn.READ_DB_HEADER].split(",")
