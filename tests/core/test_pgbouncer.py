"""The app through PgBouncer in transaction pooling mode (started by ``scripts/services.sh``).

A generation runs end to end with the web server and the worker both connected through PgBouncer
(``?pgbouncer=true``: no prepared statements, no server-side cursors), and partition rotations run
through it too, their advisory lock on ``DATABASE_DIRECT_URL``: two started at the same instant
never hold the maintenance lock at the same time, and both finish.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request

import pytest
from django.conf import settings
from django.db import connection, connections
from rest_framework.authtoken.models import Token

from specops.celery import app
from core.database_config import DIRECT_ALIAS, database_settings
from tests.helpers import wait_for
from tests.test_end_to_end import target_greedy
from tests.web_process import start_web, stop_web
from tests.worker_process import ROOT, database_url, start_worker, stop_worker

PGBOUNCER_PORT = int(os.environ.get("SPECOPS_PGBOUNCER_PORT", "6432"))


def pgbouncer_console(command: str) -> list[list[str]]:
    """One command on PgBouncer's admin console (it speaks the simple protocol only: psql)."""
    host = connection.settings_dict["HOST"] or "127.0.0.1"
    out = subprocess.run(["psql", "-h", host, "-p", str(PGBOUNCER_PORT), "-U", "postgres", "-d", "pgbouncer",
                          "-XAtq", "-F", "\t", "-c", command], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"PgBouncer on :{PGBOUNCER_PORT} does not answer ({out.stderr.strip()}); " \
                                "run scripts/services.sh up"
    return [line.split("\t") for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def through_pgbouncer(django_db_setup):
    """Environment of a process whose DATABASE_URL is PgBouncer (the test database behind it)."""
    config = {row[0]: row[1] for row in pgbouncer_console("SHOW CONFIG")}
    assert config.get("pool_mode") == "transaction", config.get("pool_mode")
    settings_dict = connection.settings_dict
    name = settings_dict["NAME"]
    # The suite itself may run through PgBouncer (DATABASE_URL on it): then its direct alias is direct.
    direct = connections[DIRECT_ALIAS].settings_dict if DIRECT_ALIAS in settings.DATABASES else settings_dict
    env = {
        "DATABASE_URL": f"postgres://{settings_dict['USER']}@{settings_dict['HOST']}:{PGBOUNCER_PORT}/{name}"
                        "?pgbouncer=true",
        "DATABASE_DIRECT_URL": database_url({**direct, "NAME": name}),
        "DATABASE_REPLICA_URLS": "",
    }
    yield env
    if int(settings_dict["PORT"]) != PGBOUNCER_PORT:
        # PgBouncer keeps server connections to the test database, and Django must be able to drop
        # it at the end. (A suite that itself runs through PgBouncer needs them until then.)
        pgbouncer_console(f"KILL {name}")
        pgbouncer_console(f"RESUME {name}")


def queries_through_pgbouncer(database: str) -> int:
    rows = pgbouncer_console("SHOW STATS")
    return sum(int(row[2]) for row in rows if row[0] == database)  # database, total_xact_count, total_query_count


def http(method: str, url: str, token: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body else None,
                                     headers={"Authorization": f"Token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_a_pgbouncer_url_gets_no_prepared_statements_no_server_cursors_and_needs_a_direct_url():
    errors: list = []
    databases, _ = database_settings("postgres://u@db:6432/app?pgbouncer=true&sslmode=disable", "", 5, errors,
                                     direct_url="postgres://u@db:5432/app")
    primary, direct = databases["default"], databases[DIRECT_ALIAS]
    assert primary["OPTIONS"]["prepare_threshold"] is None and primary["DISABLE_SERVER_SIDE_CURSORS"] is True
    assert primary["OPTIONS"]["sslmode"] == "disable" and "pgbouncer" not in primary["OPTIONS"]
    assert (direct["PORT"], direct["OPTIONS"], direct["TEST"]) == (5432, {}, {"MIRROR": "default"})  # unpooled
    assert errors == []
    assert DIRECT_ALIAS not in database_settings("postgres://u@db:5432/app", "", 5, [])[0]  # not set: none
    database_settings("postgres://u@db:6432/app?pgbouncer=true", "", 5, errors)
    assert [e[0] for e in errors] == ["specops.E002"] and "DATABASE_DIRECT_URL" in errors[0][1]


@pytest.mark.django_db(transaction=True)
def test_a_generation_runs_end_to_end_through_pgbouncer(through_pgbouncer, api_user, tiny_model, tmp_path):
    token = Token.objects.create(user=api_user).key
    database = connection.settings_dict["NAME"]
    before = queries_through_pgbouncer(database)
    app.control.purge()
    started: dict = {}

    def start(kind: str) -> None:  # web and worker start side by side: each imports torch
        try:
            started[kind] = (start_web(tmp_path / "web.log", **through_pgbouncer) if kind == "web" else
                             start_worker("cpu", "pgbouncer-cpu", tmp_path / "worker.log", extra_env=through_pgbouncer))
        except BaseException as exc:  # reported below, in the test's thread
            started[kind] = exc

    threads = [threading.Thread(target=start, args=(kind,)) for kind in ("web", "worker")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    web, worker = started.get("web"), started.get("worker")
    try:
        for process in (web, worker):
            if isinstance(process, BaseException):
                raise process
        prompt = "def parse(text):\n    "
        created = http("POST", f"{web.url}/api/v1/generations/", token,
                       {"prompt": prompt, "max_new_tokens": 16, "drafter": "draft_model"})
        body = wait_for(lambda: (lambda b: b if b["status"] in ("succeeded", "failed") else None)(
            http("GET", f"{web.url}/api/v1/sessions/{created['id']}/", token)), timeout=120, what="the generation")
        assert body["status"] == "succeeded", body["error"]
        tokens = http("GET", f"{web.url}/api/v1/sessions/{created['id']}/tokens/?page_size=50", token)["results"]
        assert [t["token_id"] for t in tokens] == target_greedy(tiny_model.directory, prompt, 16)
    finally:
        for process in (web, worker):
            if process is not None and not isinstance(process, BaseException):
                (stop_web if process is web else stop_worker)(process)
    assert queries_through_pgbouncer(database) > before  # the web and the worker really went through it


# Two rotations in one process whose DATABASE_URL is PgBouncer, in two threads (two sessions, two
# lock connections) released at the same instant; each rotates until it has run once. When each
# held the maintenance lock is recorded by wrapping the lock the plan takes.
ROTATIONS = r"""
import contextlib, json, sys, threading, time
import django
django.setup()
from django.conf import settings
from django.db import connection, connections
import metadata.partitions.plan as plan
from metadata.models import PARTITIONED_TABLES
from metadata.partitions import MaintenanceLockBusy, PartitionRotation
from metadata.partitions.locks import session_alias

table = sys.argv[1]
real_lock, start = plan.advisory_lock, threading.Barrier(2)
held, results = [], {}


@contextlib.contextmanager
def timed_lock(*args, **kwargs):
    with real_lock(*args, **kwargs):
        began = time.time()
        try:
            yield
        finally:
            held.append((threading.current_thread().name, began, time.time()))


plan.advisory_lock = timed_lock


def rotate(name):
    busy, deadline = 0, time.time() + 60
    start.wait()
    while True:
        try:
            report = PartitionRotation(tables={**PARTITIONED_TABLES, table: "created_at"},
                                       progress=lambda line: time.sleep(0.2)).run()
            break
        except MaintenanceLockBusy:
            busy += 1
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    results[name] = {"busy": busy, "created": len(report.created), "port": connection.settings_dict["PORT"]}
    connections.close_all()


threads = [threading.Thread(target=rotate, args=(name,), name=name) for name in ("a", "b")]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("RESULT " + json.dumps({"rotations": results, "held": held, "lock_alias": session_alias("default"),
                              "lock_port": settings.DATABASES[session_alias("default")]["PORT"]}), flush=True)
"""


@pytest.fixture
def rotation_table():
    """A partitioned table of the test's own (with DEFAULT), so the rotations have partitions to make."""
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE pgbouncer_rotation_probe (id bigint, created_at timestamptz NOT NULL) "
                       "PARTITION BY RANGE (created_at)")
        cursor.execute("CREATE TABLE pgbouncer_rotation_probe_default PARTITION OF pgbouncer_rotation_probe DEFAULT")
    yield "pgbouncer_rotation_probe"
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS pgbouncer_rotation_probe CASCADE")


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_rotations_through_pgbouncer_never_overlap(through_pgbouncer, rotation_table):
    result = subprocess.run([sys.executable, "-c", ROTATIONS, rotation_table], cwd=ROOT, capture_output=True,
                            text=True, timeout=180, env={**os.environ, **through_pgbouncer})
    assert result.returncode == 0, result.stdout + result.stderr
    found = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    direct = connections[DIRECT_ALIAS].settings_dict if DIRECT_ALIAS in settings.DATABASES else connection.settings_dict
    assert found["lock_alias"] == DIRECT_ALIAS and found["lock_port"] == direct["PORT"] != PGBOUNCER_PORT
    rotations = found["rotations"].values()
    assert all(r["port"] == PGBOUNCER_PORT for r in rotations)  # their queries went through PgBouncer
    intervals = sorted((began, ended, name) for name, began, ended in found["held"])
    assert sorted(name for _, _, name in intervals) == ["a", "b"]  # each ran once, under the lock
    (_, first_end, _), (second_start, _, _) = intervals
    assert first_end <= second_start  # never at the same time
    assert sum(r["busy"] for r in rotations) >= 1  # one found the lock taken and waited its turn
    assert max(r["created"] for r in rotations) >= 1  # the first made the probe table's partitions
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_inherits WHERE inhparent = 'pgbouncer_rotation_probe'::regclass")
        assert cursor.fetchone()[0] >= 2  # DEFAULT and the partitions made ahead
