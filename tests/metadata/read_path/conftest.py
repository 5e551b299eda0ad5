"""Fixtures of the read-path tests: the real streaming replica, paused or stopped and always
restored, plus a clean cache and a fresh replica snapshot for every test.

Tests that read through the replica are transactional (``transaction=True``): the replica only
sees committed rows, replicated through WAL into the mirrored test database.
"""
from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.db import connections

from inference.models import ModelVersion, VersionStatus
from metadata.cache import default_guard
from metadata.models import Session
from metadata.replicas import lsn, replica_health
from metadata.sessions import state as session_state

PG_VERSION = "15"
REPLICA_CLUSTER = "replica"
READ_PATH_MIDDLEWARE = "metadata.replicas.middleware.ReadYourWritesMiddleware"
REQUEST_LOG_MIDDLEWARE = "metadata.sessions.request_log.RequestLogMiddleware"


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


@contextmanager
def paused_replay() -> Iterator[None]:
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


def _ctl(action: str) -> None:
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", PG_VERSION, REPLICA_CLUSTER, action]
                   + (["-m", "fast"] if action == "stop" else []), check=True, capture_output=True, timeout=60)


def _replica_accepts_connections() -> bool:
    try:
        replica_replay_lsn()
        return True
    except psycopg.Error:
        return False


@contextmanager
def stopped_replica() -> Iterator[None]:
    """Stop the shared replica; always start it again and wait until it streams and catches up."""
    _ctl("stop")
    try:
        yield
    finally:
        try:
            _ctl("start")
        except subprocess.CalledProcessError as exc:
            if b"already running" not in (exc.stderr or b""):
                raise
        assert wait_until(_replica_accepts_connections, 30, 0.2), "replica did not come back"
        wait_for_replica_catch_up(30)
        # This process's replica pool saw its connections die and backs off before reconnecting
        # (psycopg_pool waits >= 1 s after a failed attempt, longer after each): a later test that
        # asks the replica directly would time out on the 1 s pool timeout. Start it afresh.
        for alias in settings.DATABASE_REPLICAS:
            connections[alias].close()
            connections[alias].close_pool()


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
    """An active target whose directory holds a tiny word-level tokenizer (for POST validation)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate("hello world speculative decoding".split())}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"})
    )
    return ModelVersion.objects.create(name="m", version="1", role="target", path=str(tmp_path),
                                       context_length=512, status=VersionStatus.ACTIVE)


def make_session(tenant, target: ModelVersion, **fields) -> Session:
    values = {"drafter": "ngram", "queue": "cpu", "prompt": "hello world", "prompt_tokens": 2,
              "params": {"max_new_tokens": 8, "temperature": 0.0}} | fields
    return Session.objects.create(tenant=tenant, target=target, **values)


def served_by(response) -> list[str]:
    return response[lsn.READ_DB_HEADER].split(",")
