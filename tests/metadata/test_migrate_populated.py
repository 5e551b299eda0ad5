"""Moving ``ModelVersion`` from the inference app to the store keeps every table, row and partition.

A database of this module's own (``specops_migrate_<hex>``, made here and dropped at the end; the
suite's test database is shared by the workers and must not be migrated backwards) is migrated
by ``manage.py`` subprocesses to the state before the move (every migration but metadata 0017 and
inference 0007-0008: the graph asks no other node to wait), then populated through psycopg with
raw SQL in the schema of that state: a tenant, users, a token, model versions (a draft, an active
target naming it, an int8 variant of the target), the model version's content type
``inference.modelversion`` with a permission granted to a user and a group and the admin's log of
the target, sessions, tokens, candidates, request log rows and statement snapshots in three
partitions of each table (today's, tomorrow's and DEFAULT), and a row in every other table of
the project's apps. Then ``migrate`` (the command, in a ``manage.py shell`` that then reads the
result through the ORM) takes it to the latest state, and the checks are
that nothing changed but what the three migrations mean to change.

The state before the move is made with today's history, whose metadata 0001 already creates
``ModelVersion`` in the store's state: ``post_migrate`` therefore makes a ``metadata.modelversion``
content type (and its four permissions) at that point, which no database migrated by the history
before the move has (checked by hand against a database migrated at the parent of 8bed6f7: same
tables, columns (inference_modelversion's in another order), indexes and constraints, and its only
model version content type is ``inference.modelversion``). The fixture removes those five unused
rows, so the database is one a deployment has (the round trip below meets the other case).

The round trip (``manage.py migrate metadata 0016`` and forward again) is checked too: every row
and partition stays, and so does the content type's id: migrating backwards renames it to the
inference app, the backwards ``migrate``'s ``post_migrate`` makes a new ``metadata.modelversion``,
and going forward again metadata 0017 merges that one (its permissions, their grants and its log
entries) into the renamed one.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.db.migrations.loader import MigrationLoader
from psycopg import sql

from metadata.models import PARTITIONED_TABLES
from metadata.partitions import PartitionPolicy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent.parent
BEFORE = {"metadata": "0016_tenant_prefix_cache_group", "inference": "0006_idempotency_key"}
THE_MOVE = {("metadata", "0017_model_version_content_type"), ("inference", "0007_model_version_is_the_stores"),
            ("inference", "0008_register_reconcile_job")}
# Tables the migrations of the move write to, on purpose; every other table keeps every row as it was.
WRITTEN_BY_THE_MOVE = {
    "django_migrations": "the three migrations are recorded",
    "django_content_type": "metadata 0017 renames the model version's content type (checked apart)",
    "django_celery_beat_periodictask": "inference 0008 registers the reconciler's beat job",
    "django_celery_beat_periodictasks": "registering a beat job bumps its last_update",
    "django_celery_beat_intervalschedule": "the reconciler's job may need an interval of its own",
}
# Migrating backwards and forward again also makes the store's content type's permissions anew (see
# the round trip's tests).
WRITTEN_BY_A_ROUND_TRIP = {**WRITTEN_BY_THE_MOVE,
                           "auth_permission": "post_migrate makes the permissions of a content type it makes"}
ROWS_COMPARED = set(WRITTEN_BY_A_ROUND_TRIP)  # tables whose rows a snapshot keeps, to compare row by row
SUBPROCESS_TIMEOUT = 300
RESULT_MARK = "MIGRATE-TEST-RESULT "

BEFORE_STATE_SCRIPT = f"""
from django.core.management import call_command
from django.db import connection
from django.db.migrations.loader import MigrationLoader
before = {BEFORE!r}
for app, name in before.items():
    call_command("migrate", app, name, verbosity=1)
for app in sorted(MigrationLoader(connection).migrated_apps - set(before)):
    call_command("migrate", app, verbosity=1)
"""

ORM_SCRIPT = f"""
import io, json
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from metadata.models import Candidate, ModelVersion, Session, TokenRecord

out = io.StringIO()
try:
    call_command("makemigrations", check=True, dry_run=True, stdout=out, stderr=out)
    makemigrations = 0
except SystemExit as exc:
    makemigrations = exc.code
meta = ModelVersion._meta
content_type_ids = list(ContentType.objects.filter(app_label=meta.app_label, model=meta.model_name)
                        .values_list("id", flat=True))
users = get_user_model().objects
versions = list(ModelVersion.objects.order_by("id").values())
print({RESULT_MARK!r} + json.dumps({{
    "makemigrations": makemigrations, "makemigrations_out": out.getvalue(),
    "label": meta.label, "db_table": meta.db_table, "content_type_ids": content_type_ids,
    "versions": versions,
    "target_default_draft": ModelVersion.objects.get(role="target", variant="original").default_draft.pk,
    "has_perm": {{u.username: u.has_perm("metadata.change_modelversion") for u in users.order_by("id")}},
    "log_entries": LogEntry.objects.filter(content_type_id__in=content_type_ids).count(),
    "sessions_of_target": Session.objects.filter(target__role="target", target__variant="original").count(),
    "tokens": TokenRecord.objects.count(), "candidates": Candidate.objects.count(),
}}, default=lambda value: value.isoformat() if hasattr(value, "isoformat") else str(value)))
"""


# --------------------------------------------------------------------------------------------
# The database of this module, and manage.py on it

def server_params() -> dict:
    config = settings.DATABASES["default"]
    return {"host": config["HOST"] or "127.0.0.1", "port": int(config["PORT"] or 5432),
            "user": config["USER"] or "postgres", "password": config["PASSWORD"] or None}


def database_url(name: str) -> str:
    params = server_params()
    auth = params["user"] + (f":{params['password']}" if params["password"] else "")
    return f"postgres://{auth}@{params['host']}:{params['port']}/{name}"


def manage(database: str, *args: str) -> str:
    """``manage.py <args>`` on ``database`` alone: no replica (the suite's replica would be read
    otherwise), no direct alias; Redis, keys and the rest as this run's. Its output on success."""
    env = {**os.environ, "DATABASE_URL": database_url(database), "DATABASE_REPLICA_URLS": "",
           "DATABASE_DIRECT_URL": "", "HF_HUB_OFFLINE": "1"}
    env.setdefault("SECRET_KEY", "test-only-secret-key-not-for-production-0123456789")
    result = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=SUBPROCESS_TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"manage.py {' '.join(args[:2])} failed ({result.returncode}):\n{output[-6000:]}"
    return output


def shell(database: str, script: str) -> str:
    return manage(database, "shell", "--no-imports", "-c", script)


# ``manage.py migrate``'s own command, then the ORM's view of the result, in one Django start
# (each start is seconds of CPU; the view only reads, so it sees what a new process would)
MIGRATE_THEN_ORM_SCRIPT = ("from django.core.management import call_command\n"
                           "call_command('migrate', interactive=False)\n" + ORM_SCRIPT)


def orm_view(database: str, script: str = ORM_SCRIPT) -> tuple[dict, str]:
    """What the ORM reads (``ORM_SCRIPT``, run last by ``script``), and the whole output."""
    output = shell(database, script)
    lines = [line for line in output.splitlines() if line.startswith(RESULT_MARK)]
    assert len(lines) == 1, output[-6000:]
    return json.loads(lines[0].removeprefix(RESULT_MARK)), output


def connect(database: str) -> psycopg.Connection:
    return psycopg.connect(dbname=database, autocommit=True, **server_params())


# --------------------------------------------------------------------------------------------
# What the database holds

def snapshot(conn: psycopg.Connection) -> dict:
    """Every table and partition with its row count and a checksum of its rows, the partitions of
    each partitioned table with their bounds, the schema, applied migrations and content types."""
    tables = {}
    names = conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') ORDER BY 1").fetchall()
    for (name,) in names:
        tables[name] = conn.execute(sql.SQL(
            "SELECT count(*), md5(coalesce(string_agg(t::text, E'\\n' ORDER BY t::text), '')) FROM {} t"
        ).format(sql.Identifier(name))).fetchone()
    partitions: dict[str, dict[str, str]] = {}
    for parent, child, bound in conn.execute(
            "SELECT p.relname, c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent "
            "JOIN pg_namespace n ON n.oid = p.relnamespace WHERE n.nspname = 'public' AND p.relkind = 'p'"):
        partitions.setdefault(parent, {})[child] = bound
    columns = set(conn.execute(
        "SELECT table_name, column_name, data_type, is_nullable, coalesce(column_default, '') "
        "FROM information_schema.columns WHERE table_schema = 'public'").fetchall())
    indexes = set(conn.execute("SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'"))
    constraints = set(conn.execute(
        "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(c.oid) FROM pg_constraint c "
        "JOIN pg_namespace n ON n.oid = c.connamespace WHERE n.nspname = 'public'"))
    return {
        "tables": tables, "partitions": partitions, "columns": columns, "indexes": indexes,
        "constraints": constraints,
        "rows": {name: set(row for (row,) in conn.execute(sql.SQL("SELECT t::text FROM {} t").format(
            sql.Identifier(name)))) for name in ROWS_COMPARED},
        "applied": set(conn.execute("SELECT app, name FROM django_migrations").fetchall()),
        "model_version_types": dict(conn.execute(
            "SELECT app_label, id FROM django_content_type WHERE model = 'modelversion'").fetchall()),
        "versions": [row for (row,) in conn.execute(
            "SELECT row_to_json(m)::text FROM inference_modelversion m ORDER BY id")],
    }


def assert_kept(before: dict, after: dict, written: dict[str, str], what: str) -> None:
    """Every table, partition, index, constraint and column of ``before`` is in ``after``; every
    table but ``written`` has the same rows; those keep every row they had, and may have more
    (django_migrations: checked by the callers; the content types and beat's one change-marker row:
    as many rows)."""
    lost_tables = sorted(set(before["tables"]) - set(after["tables"]))
    assert not lost_tables, f"{what}: tables gone: {lost_tables}"
    changed = {name: (counted, after["tables"][name]) for name, counted in before["tables"].items()
               if name not in written and after["tables"][name] != counted}
    assert not changed, f"{what}: tables whose rows changed ((count, md5) before, after): {changed}"
    for name in written:
        if name == "django_migrations":
            continue
        if name in ("django_content_type", "django_celery_beat_periodictasks"):
            assert after["tables"][name][0] >= before["tables"][name][0], f"{what}: rows of {name} gone"
            continue
        lost = before["rows"][name] - after["rows"][name]
        assert not lost, f"{what}: rows of {name} gone or changed: {sorted(lost)}"
    for parent, children in before["partitions"].items():
        kept = after["partitions"].get(parent, {})
        assert {c: kept.get(c) for c in children} == children, f"{what}: partitions of {parent} gone or rebound"
        for child in set(kept) - set(children):  # a day that began meanwhile: made ahead, empty
            assert after["tables"][child][0] == 0, f"{what}: new partition {child} has rows"
    for part in ("columns", "indexes", "constraints"):
        assert before[part] <= after[part], f"{what}: {part} gone: {sorted(before[part] - after[part])}"


# --------------------------------------------------------------------------------------------
# The database before the move, populated

def remove_the_store_content_type_a_deployment_never_had(conn: psycopg.Connection) -> None:
    """See the module's docstring: ``metadata.modelversion`` appeared at this state only because
    today's history has the model in the store from metadata 0001; its rows are unused so far."""
    (type_id,) = conn.execute(
        "SELECT id FROM django_content_type WHERE app_label = 'metadata' AND model = 'modelversion'").fetchone()
    codenames = {c for (c,) in conn.execute("SELECT codename FROM auth_permission WHERE content_type_id = %s",
                                            [type_id])}
    assert codenames == {f"{a}_modelversion" for a in ("add", "change", "delete", "view")}
    conn.execute("DELETE FROM auth_permission WHERE content_type_id = %s", [type_id])
    conn.execute("DELETE FROM django_content_type WHERE id = %s", [type_id])


def populate(conn: psycopg.Connection) -> dict:
    """Rows in every table of the project's apps, with the columns these tables have at this state."""
    now = dt.datetime.now(dt.timezone.utc)
    days = [now, now + dt.timedelta(days=1), dt.datetime(2001, 2, 3, 4, 5, tzinfo=dt.timezone.utc)]  # last: DEFAULT
    one = lambda query, params=(): conn.execute(query, params).fetchone()[0]  # noqa: E731
    (type_id,) = conn.execute(
        "SELECT id FROM django_content_type WHERE app_label = 'inference' AND model = 'modelversion'").fetchone()
    change_perm = one("SELECT id FROM auth_permission WHERE content_type_id = %s AND codename = 'change_modelversion'",
                      [type_id])
    view_perm = one("SELECT id FROM auth_permission WHERE content_type_id = %s AND codename = 'view_modelversion'",
                    [type_id])
    users = {}
    for username in ("promoter", "in_group", "bystander"):
        users[username] = one(
            "INSERT INTO auth_user (password, is_superuser, username, first_name, last_name, email, is_staff, "
            "is_active, date_joined) VALUES ('!', false, %s, '', '', '', true, true, %s) RETURNING id", [username, now])
    conn.execute("INSERT INTO auth_user_user_permissions (user_id, permission_id) VALUES (%s, %s)",
                 [users["promoter"], change_perm])
    group = one("INSERT INTO auth_group (name) VALUES ('promoters') RETURNING id")
    conn.execute("INSERT INTO auth_group_permissions (group_id, permission_id) VALUES (%s, %s), (%s, %s)",
                 [group, change_perm, group, view_perm])
    conn.execute("INSERT INTO auth_user_groups (user_id, group_id) VALUES (%s, %s)", [users["in_group"], group])
    conn.execute("INSERT INTO authtoken_token (key, created, user_id) VALUES (%s, %s, %s)",
                 [uuid.uuid4().hex + "12345678", now, users["promoter"]])
    conn.execute("INSERT INTO django_session (session_key, session_data, expire_date) VALUES (%s, 'e30:1', %s)",
                 [uuid.uuid4().hex, now + dt.timedelta(days=14)])
    tenant = one("INSERT INTO metadata_tenant (name, created_at, max_live_generations, max_open_streams, "
                 "prefix_cache_group) VALUES ('acme', %s, 3, NULL, 'g1') RETURNING id", [now])
    conn.execute("INSERT INTO metadata_tenantmembership (tenant_id, user_id) VALUES (%s, %s)",
                 [tenant, users["promoter"]])

    version = ("INSERT INTO inference_modelversion (name, version, role, path, device, context_length, "
               "attn_implementation, dtype, status, dspark_path, created_at, promoted_at, variant, recipe, figures, "
               "default_draft_id, base_id) VALUES (%s, %s, %s, %s, 'cpu', 2048, 'sdpa', %s, %s, %s, %s, %s, %s, %s, "
               "%s, %s, %s) RETURNING id")
    draft = one(version, ["tiny-draft", "3", "draft", "/models/draft", "", "active", "", now, now, "original", "{}",
                          "{}", None, None])
    target = one(version, ["tiny", "3", "target", "/models/target", "bfloat16", "active", "/models/dspark", now, now,
                           "original", "{}", '{"tokens_per_s": 41.5}', draft, None])
    one(version, ["tiny", "3-int8", "target", "/models/target-int8", "", "staged", "", now, None, "int8",
                  '{"kind": "int8", "from": "tiny:3"}', '{"size_mb": 12}', draft, target])
    for flag, message in ((1, "[]"), (2, '[{"changed": {"fields": ["Status"]}}]')):
        conn.execute("INSERT INTO django_admin_log (action_time, object_id, object_repr, action_flag, change_message, "
                     "content_type_id, user_id) VALUES (%s, %s, 'tiny:3 target', %s, %s, %s, %s)",
                     [now, str(target), flag, message, type_id, users["promoter"]])

    sessions = []
    for n, created_at in enumerate(days):
        session = one(
            "INSERT INTO metadata_session (id, created_at, updated_at, last_activity_at, status, drafter, queue, "
            "prompt, prompt_tokens, params, token_count, text, finish_reason, error, stats, started_at, finished_at, "
            "created_by_id, draft_id, target_id, tenant_id, attempts, lease_expires_at, worker, enqueued_at) "
            "VALUES (gen_random_uuid(), %s, %s, %s, 'succeeded', 'model', 'cpu', 'Hello', 2, '{}', %s, 'world', "
            "'length', '', '{}', %s, %s, %s, %s, %s, %s, 1, NULL, 'w1', %s) RETURNING id",
            [created_at, created_at, created_at, 5 + n, created_at, created_at, users["promoter"], draft, target,
             tenant, created_at])
        sessions.append(session)
        conn.execute(
            "INSERT INTO metadata_token (session_id, session_created_at, position, step, token_id, piece, kind, "
            "logprob) SELECT %s, %s, g, g / 4, g %% 50257, 'tok' || g, g %% 4, -g / 1000.0 "
            "FROM generate_series(0, %s) g",
            [session, created_at, 4 + n])
        conn.execute(
            "INSERT INTO metadata_candidate (session_id, session_created_at, step, branch, token_ids, score, "
            "accepted_len) SELECT %s, %s, g / 3, g %% 3, jsonb_build_array(g, g + 1), (g %% 17) / 4.0, g %% 4 "
            "FROM generate_series(0, %s) g", [session, created_at, 5 + n])
        conn.execute("INSERT INTO metadata_request_log (id, requested_at, method, path, status_code, duration_ms, "
                     "session_id, tenant_id) VALUES (gen_random_uuid(), %s, 'POST', '/api/v1/generate', 202, 12.5, "
                     "%s, %s)", [created_at, session, tenant])
        conn.execute("INSERT INTO metadata_statement_snapshot (taken_at, interval_s, database, queryid, query, family, "
                     "source, calls, total_time_ms, max_time_ms, rows, shared_blks_hit, shared_blks_read, "
                     "shared_blks_dirtied, shared_blks_written) VALUES (%s, 60, 'default', %s, 'SELECT 1', "
                     "'select', '', 3, 1.5, 1.0, 3, 10, 1, 0, 0)", [created_at, 1000 + n])
    conn.execute("INSERT INTO inference_idempotencykey (key, fingerprint, claim, session_id, status_code, created_at, "
                 "expires_at, user_id) VALUES ('k1', %s, gen_random_uuid(), %s, 202, %s, %s, %s)",
                 ["0" * 64, sessions[0], now, now + dt.timedelta(days=1), users["promoter"]])
    conn.execute("INSERT INTO inference_canarymismatch (session_id, session_created_at, model, drafter, "
                 "first_difference, served_tokens, replayed_tokens, served_text, replayed_text, created_at) "
                 "VALUES (%s, %s, 'tiny:3', 'model', 2, '[1, 2, 3]', '[1, 2, 4]', 'a', 'b', %s)",
                 [sessions[0], days[0], now])
    conn.execute("INSERT INTO metadata_cachestatssnapshot (taken_at, cache, tier, hits, misses, coalesced) "
                 "VALUES (%s, 'token', 'local', 10, 2, 1)", [now])
    conn.execute("INSERT INTO metadata_statementbaseline (database, queryid, taken_at, query, calls, total_time_ms, "
                 "max_time_ms, rows, shared_blks_hit, shared_blks_read, shared_blks_dirtied, shared_blks_written) "
                 "VALUES ('default', 1000, %s, 'SELECT 1', 3, 1.5, 1.0, 3, 10, 1, 0, 0)", [now])
    job = one("INSERT INTO metadata_partitionarchivaljob (parent_table, partition, range_start, range_end, step, "
              "archive_path, row_count, checksum, error, failed_step, created_at, updated_at, finished_at, "
              "archive_bytes, archive_sha256, attempts, relation_oid) VALUES ('metadata_token', "
              "'metadata_token_p20010101', '2001-01-01', '2001-01-02', 'dropped', '/archive/t.csv.gz', 4, 'abc', '', "
              "'', %s, %s, %s, 123, %s, 1, NULL) RETURNING id", [now, now, now, "f" * 64])
    conn.execute("INSERT INTO metadata_maintenance_run (action, target, archival_job_id, options, requested_at, "
                 "started_at, finished_at, updated_at, status, progress_done, progress_total, progress_line, outcome, "
                 "error, task_id, requested_by_id) VALUES ('archive', 'metadata_token_p20010101', %s, '{}', %s, %s, "
                 "%s, %s, 'succeeded', 1, 1, 'done', '{}', '', 't1', %s)", [job, now, now, now, now, users["promoter"]])
    conn.execute("INSERT INTO metadata_ops_rollup (start, width, series, key, count, total, buckets, values, "
                 "updated_at) VALUES (%s, 1, 'latency', '', 3, 0.5, '{1,2}', '{}', %s)", [now, now])
    return {"users": users, "target": target, "content_type": type_id, "change_perm": change_perm}


# --------------------------------------------------------------------------------------------
# Fixtures: the states of the module's database

@pytest.fixture(scope="module")
def database():
    name = f"specops_migrate_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dbname="postgres", autocommit=True, **server_params()) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(dbname="postgres", autocommit=True, **server_params()) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="module")
def every_migration() -> set[tuple[str, str]]:
    return set(MigrationLoader(None, ignore_no_migrations=True).graph.nodes)


@pytest.fixture(scope="module")
def moved(database, every_migration) -> dict:
    """The database before the move, populated (``before``), and migrated forward (``after``)."""
    shell(database, BEFORE_STATE_SCRIPT)
    with connect(database) as conn:
        remove_the_store_content_type_a_deployment_never_had(conn)
        rows = populate(conn)
        before = snapshot(conn)
    view, output = orm_view(database, MIGRATE_THEN_ORM_SCRIPT)
    with connect(database) as conn:
        after = snapshot(conn)
    return {"rows": rows, "before": before, "after": after, "view": view, "output": output}


@pytest.fixture(scope="module")
def round_trip(database, moved) -> dict:
    """``moved``'s database migrated back to the state before the move (``back``), then forward (``again``)."""
    manage(database, "migrate", "--no-input", "metadata", BEFORE["metadata"])
    with connect(database) as conn:
        back = snapshot(conn)
    manage(database, "migrate", "--no-input")
    with connect(database) as conn:
        again = snapshot(conn)
    return {"back": back, "again": again}


# --------------------------------------------------------------------------------------------
# Tests

def test_the_state_before_the_move_is_populated_in_partitions(moved, every_migration) -> None:
    before = moved["before"]
    assert before["applied"] == every_migration - THE_MOVE
    assert before["model_version_types"] == {"inference": moved["rows"]["content_type"]}
    premade = PartitionPolicy.from_settings().premake
    for parent in PARTITIONED_TABLES:
        children = before["partitions"][parent]
        ranges = [child for child, bound in children.items() if bound != "DEFAULT"]
        assert f"{parent}_default" in children and len(ranges) >= premade + 1, children
    for parent in ("metadata_session", "metadata_token", "metadata_candidate", "metadata_request_log",
                   "metadata_statement_snapshot"):
        holding = {c for c in before["partitions"][parent] if before["tables"][c][0]}
        assert len(holding) == 3 and f"{parent}_default" in holding, (parent, holding)
    empty = sorted(name for name, (count, _) in before["tables"].items() if not count
                   and name.startswith(("metadata_", "inference_", "ops_")) and name not in before["partitions"]
                   and not any(name in children for children in before["partitions"].values()))
    assert empty == [], f"tables of the project's apps left empty: {empty}"


def test_migrating_forward_keeps_every_table_row_and_partition(moved, every_migration) -> None:
    before, after = moved["before"], moved["after"]
    assert after["applied"] == every_migration
    assert after["applied"] - before["applied"] == THE_MOVE
    assert_kept(before, after, WRITTEN_BY_THE_MOVE, "forward")
    # Nothing of the schema changed at all (the move is state only), not even an added index.
    for part in ("columns", "indexes", "constraints"):
        assert after[part] == before[part], part
    # The content types: the model version's is renamed (next test), every other one is as it was.
    others = lambda rows: {row for row in rows if not row.endswith(",modelversion)")}  # noqa: E731
    assert others(after["rows"]["django_content_type"]) == others(before["rows"]["django_content_type"])
    assert after["tables"]["django_content_type"][0] == before["tables"]["django_content_type"][0]
    assert after["versions"] == before["versions"]


def test_the_content_type_moves_with_its_id_permissions_and_log(moved) -> None:
    rows = moved["rows"]
    assert moved["after"]["model_version_types"] == {"metadata": rows["content_type"]}
    view = moved["view"]
    assert view["makemigrations"] == 0, view["makemigrations_out"]
    assert "No changes detected" in view["makemigrations_out"]
    assert (view["label"], view["db_table"]) == ("metadata.ModelVersion", "inference_modelversion")
    assert view["content_type_ids"] == [rows["content_type"]]
    assert view["has_perm"] == {"promoter": True, "in_group": True, "bystander": False}
    assert view["log_entries"] == 2
    assert view["target_default_draft"] == view["versions"][0]["id"]
    assert (view["sessions_of_target"], view["tokens"], view["candidates"]) == (3, 5 + 6 + 7, 6 + 7 + 8)
    # The ORM reads every column of every version as it was written (the rows through SQL are compared above).
    by_sql = [json.loads(row) for row in moved["before"]["versions"]]
    assert [sorted(v) for v in view["versions"]] == [sorted(v) for v in by_sql]
    for orm, raw in zip(view["versions"], by_sql):
        for field, value in raw.items():
            if field.endswith("_at") and value is not None:
                assert dt.datetime.fromisoformat(orm[field].replace("Z", "+00:00")) == dt.datetime.fromisoformat(value)
            else:
                assert orm[field] == value, field


def test_a_round_trip_keeps_every_row_and_partition(moved, round_trip, every_migration) -> None:
    after, back, again = moved["after"], round_trip["back"], round_trip["again"]
    assert back["applied"] == every_migration - THE_MOVE
    assert again["applied"] == every_migration
    # Backwards: the content type goes back to the inference app; ``post_migrate`` of that state
    # makes the store's one again, with its four permissions (see the next test).
    assert_kept(after, back, WRITTEN_BY_A_ROUND_TRIP, "backwards")
    # Forward again: 0017 merges the content type made meanwhile into the renamed one, so the
    # database is the one before the round trip (its grants tables compared row for row above)
    assert_kept(after, again, WRITTEN_BY_A_ROUND_TRIP, "forward again")
    for table in ("django_content_type", "auth_permission"):
        assert again["rows"][table] == after["rows"][table], table
    assert back["versions"] == again["versions"] == after["versions"]
    assert back["model_version_types"]["inference"] == moved["rows"]["content_type"]


def test_a_round_trip_keeps_the_content_type(moved, round_trip) -> None:
    """The backwards migrate's post_migrate makes a new metadata.modelversion; going forward again,
    0017 merges it into the renamed one, so the content type keeps its id (and with it every
    permission grant and the admin's history of the versions)."""
    assert round_trip["again"]["model_version_types"] == {"metadata": moved["rows"]["content_type"]}
