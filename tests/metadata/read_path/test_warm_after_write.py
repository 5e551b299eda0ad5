"""A worker's update leaves the session's state in Redis: another process's first read of it is
served from Redis, without a database query (issue 28: the warm read path had gone cold).

The reader is a fresh Python process (empty in-process tier, connections of its own, every
statement on every alias counted), pointed at this test's databases and Redis database.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from django.db import connections, transaction
from django.db.models import F

from metadata.models import Session
from metadata.replicas import lsn
from sessions.state import STATE, cache_for, invalidate_session
from tests.metadata.read_path.conftest import make_session
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

READER = """
import json, os, sys, threading, django
django.setup()
from django.db import connections
from django.db.backends.signals import connection_created

for alias, name in json.loads(os.environ["READER_DATABASE_NAMES"]).items():
    connections[alias].settings_dict["NAME"] = name  # the test databases, as pytest-django set them

counts, lock = {}, threading.Lock()

def count(execute, sql, params, many, context):
    with lock:
        alias = context["connection"].alias
        counts[alias] = counts.get(alias, 0) + 1
    return execute(sql, params, many, context)

def install(sender, connection, **kwargs):
    if count not in connection.execute_wrappers:
        connection.execute_wrappers.append(count)

connection_created.connect(install, weak=False)

from metadata.replicas import lsn
from sessions.state import STATE, cache_for, get_session_state

with lsn.floor_scope(int(os.environ["READER_FLOOR"])):  # the floor a client of the writer carries
    state = get_session_state(os.environ["READER_SESSION"])
    served = lsn.served_by()
print(json.dumps({"token_count": state and state["token_count"], "served_by": list(served),
                  "queries": counts, "loads": cache_for(STATE).loads}))
"""


def read_in_another_process(session_id: str, floor: int) -> dict:
    root = REPO_ROOT
    names = {alias: connections[alias].settings_dict["NAME"] for alias in connections}
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "specops.settings", "READER_SESSION": session_id,
           "READER_FLOOR": str(floor), "READER_DATABASE_NAMES": json.dumps(names)}
    out = subprocess.run([sys.executable, "-c", READER], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_state_written_through_at_a_worker_update_is_read_from_redis_by_another_process(tenant, target_version):
    session = make_session(tenant, target_version)
    sid = str(session.pk)

    # What the worker does after a token batch (inference.worker.recording): update the row and
    # invalidate its cache entries in the same transaction; the cache acts after the commit.
    with lsn.floor_scope():
        with transaction.atomic():
            Session.objects.filter(pk=sid).update(token_count=F("token_count") + 5)
            invalidate_session(sid)
        floor = lsn.current().lsn

    read = read_in_another_process(sid, floor)
    assert read["token_count"] == 5
    assert read["served_by"] == ["cache:redis"], "the update left no state in Redis: the next burst starts cold"
    assert read["loads"] == 0
    assert sum(read["queries"].values()) == 0, read["queries"]

    entry, key_floor = cache_for(STATE).redis.get(cache_for(STATE).key(sid))
    assert entry.value["token_count"] == 5 and entry.source_lsn >= key_floor >= floor > 0
