"""Converting a live table into a partitioned one: concurrent writers lose nothing, a crash at any
phase resumes, an empty table is quick, a partitioned one is a no-op, and mistakes are refused.

Each test makes tables of its own, shaped like the sessions table (uuid key, created_at, status,
text, a covering INCLUDE index, a partial index on live statuses, a FK to a tenants table), and
checks the result against a ledger of every write the writer threads committed.
"""
from __future__ import annotations

import datetime as dt
import io
import random
import threading
import time
import uuid

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from metadata.partitions import PartitionPolicy, catalog
from metadata.partitions.conversion import (
    STATE_TABLE,
    TableConversionError,
    conversion_state,
    convert_to_partitioned,
    relkind,
)
from metadata.partitions.pacing import Pacer
from tests.metadata.partition_helpers import BackgroundThreads

TABLE, TENANTS = "conv_session", "conv_tenant"
POLICY = PartitionPolicy(interval=dt.timedelta(days=1), premake=2)
STATUSES = ("queued", "running", "succeeded", "failed")
INDEXES = {"conv_state_covering", "conv_live_partial", "conv_tenant_recent"}
NOW = dt.datetime.now(dt.timezone.utc)

pytestmark = pytest.mark.django_db(transaction=True)


class Crash(BaseException):
    """What a killed process looks like to the code under test: nothing catches it."""


def execute(sql: str, params: list | None = None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def conninfo() -> str:
    params = connection.settings_dict
    return psycopg.conninfo.make_conninfo(dbname=params["NAME"], user=params.get("USER") or None,
                                          password=params.get("PASSWORD") or None,
                                          host=params.get("HOST") or None, port=params.get("PORT") or None)


def drop_tables() -> None:
    execute(f"DROP TABLE IF EXISTS {TABLE}, {TABLE}_partitioned, {TABLE}_unpartitioned, conv_ref, "
            f"conv_parted, {TENANTS} CASCADE")
    execute(f"DROP FUNCTION IF EXISTS {TABLE}_conversion_mirror(), {TABLE}_conversion_mirror_t() CASCADE")
    if catalog.relation_exists(STATE_TABLE):
        execute(f"DELETE FROM {STATE_TABLE} WHERE source_table LIKE 'conv_%%'")


@pytest.fixture
def session_table():
    """``conv_session`` with ``rows`` rows over the last 10 days: call it with the row count."""
    drop_tables()

    def make(rows: int) -> list[str]:
        execute(f"CREATE TABLE {TENANTS} (id bigint PRIMARY KEY, name text NOT NULL)")
        execute(f"INSERT INTO {TENANTS} VALUES (1, 'a'), (2, 'b')")
        execute(f"""CREATE TABLE {TABLE} (
            id uuid PRIMARY KEY,
            tenant_id bigint NOT NULL REFERENCES {TENANTS} (id) DEFERRABLE INITIALLY DEFERRED,
            created_at timestamptz NOT NULL,
            last_activity_at timestamptz NOT NULL,
            status varchar(16) NOT NULL,
            token_count integer NOT NULL CHECK (token_count >= 0),
            text text NOT NULL DEFAULT '')""")
        execute(f"CREATE INDEX conv_state_covering ON {TABLE} (id) INCLUDE (status, token_count)")
        execute(f"CREATE INDEX conv_live_partial ON {TABLE} (last_activity_at) WHERE status IN ('queued', 'running')")
        execute(f"CREATE INDEX conv_tenant_recent ON {TABLE} (tenant_id, created_at DESC, id)")
        execute(
            f"INSERT INTO {TABLE} (id, tenant_id, created_at, last_activity_at, status, token_count, text) "
            f"SELECT gen_random_uuid(), 1 + g %% 2, t, t, (ARRAY['queued','running','succeeded','failed'])[1 + g %% 4], "
            f"g %% 100, 'row ' || g FROM (SELECT g, now() - random() * interval '10 days' AS t "
            f"FROM generate_series(1, %s) g) s", [rows])
        return [str(i) for (i,) in execute(f"SELECT id FROM {TABLE} ORDER BY id")]

    yield make
    drop_tables()


def table_rows() -> dict[str, tuple]:
    return {str(i): tuple(rest) for i, *rest in
            (tuple(r) for r in execute(f"SELECT id, created_at, status, token_count, text FROM {TABLE}"))}


class Ledger:
    """Rows as the writers last committed them (None: deleted), checked against the table."""

    def __init__(self, rows: dict[str, tuple]) -> None:
        self.rows: dict[str, tuple | None] = dict(rows)

    def expected(self) -> dict[str, tuple]:
        return {k: v for k, v in self.rows.items() if v is not None}


class Writers(BackgroundThreads):
    """Threads with connections of their own inserting, updating (the partition key and the
    primary key too) and deleting rows; each thread owns the rows it touches, so the ledger is exact at every commit."""

    def __init__(self, ledger: Ledger, threads: int = 3) -> None:
        self.ledger, self.stop = ledger, threading.Event()
        self.errors: list[BaseException] = []
        self.commits: list[float] = []
        owned = sorted(ledger.rows)
        self.threads = [threading.Thread(target=self._run, args=(n, owned[n::threads]), daemon=True)
                        for n in range(threads)]

    def _run(self, seed: int, owned: list[str]) -> None:
        rng = random.Random(seed)
        alive = list(owned)
        try:
            with psycopg.connect(conninfo(), autocommit=True) as conn:
                while not self.stop.is_set():
                    self._one(conn, rng, alive)
                    self.commits.append(time.time())
                    time.sleep(0.002)
        except BaseException as exc:  # reported by the test: writers must see no error
            self.errors.append(exc)

    def _one(self, conn, rng: random.Random, alive: list[str]) -> None:
        op = rng.random()
        if op < 0.35 or len(alive) < 4:
            key = str(uuid.uuid4())
            # now, the last 10 days, or 30-90 days back: days that mostly have no partition (DEFAULT)
            days = rng.choice([0.0, 0.0, rng.uniform(0, 10), rng.uniform(30, 90)])
            row = (NOW - dt.timedelta(days=days), rng.choice(STATUSES), rng.randrange(100), f"new {key[:8]}")
            conn.execute(f"INSERT INTO {TABLE} (id, tenant_id, created_at, last_activity_at, status, token_count, "
                         f"text) VALUES (%s, 1, %s, %s, %s, %s, %s)", (key, row[0], row[0], *row[1:]))
            self.ledger.rows[key] = row
            alive.append(key)
        elif op < 0.75:
            key, row = self._update(conn, rng, rng.choice(alive))
            self.ledger.rows[key] = row
        elif op < 0.85:
            with conn.transaction():  # two rows in one transaction, in random order
                updated = [self._update(conn, rng, key) for key in rng.sample(alive, 2)]
            self.ledger.rows.update(updated)
        elif op < 0.9:  # a new primary key: the row leaves the copy's key range for another
            key, new_key = alive.pop(rng.randrange(len(alive))), str(uuid.uuid4())
            conn.execute(f"UPDATE {TABLE} SET id = %s WHERE id = %s", (new_key, key))
            self.ledger.rows[new_key], self.ledger.rows[key] = self.ledger.rows[key], None
            alive.append(new_key)
        else:
            key = alive.pop(rng.randrange(len(alive)))
            conn.execute(f"DELETE FROM {TABLE} WHERE id = %s", (key,))
            self.ledger.rows[key] = None

    def _update(self, conn, rng: random.Random, key: str) -> tuple[str, tuple]:
        created, _, count, _ = self.ledger.rows[key]
        if rng.random() < 0.15:
            created = NOW - dt.timedelta(days=rng.uniform(0, 10))  # moves the row to another partition
        row = (created, rng.choice(STATUSES), count + 1, f"upd {rng.random():.6f}")
        conn.execute(f"UPDATE {TABLE} SET created_at = %s, status = %s, token_count = %s, text = %s, "
                     f"last_activity_at = now() WHERE id = %s", (*row, key))
        return key, row


def assert_converted(keep_old: bool = True) -> None:
    assert relkind(TABLE) == "p"
    names = {name for (name,) in execute("SELECT c.relname FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid "
                                         "WHERE x.indrelid = %s::regclass", [TABLE])}
    assert names == INDEXES | {f"{TABLE}_pkey"}
    key = execute(f"SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = '{TABLE}'::regclass "
                  f"AND conname = '{TABLE}_pkey'")
    assert key == [("PRIMARY KEY (id, created_at)",)]
    fks = execute(f"SELECT confrelid::regclass::text FROM pg_constraint WHERE conrelid = '{TABLE}'::regclass "
                  f"AND contype = 'f'")
    assert fks == [(TENANTS,)]
    partitions = catalog.list_partitions(TABLE)
    assert any(p.is_default and p.name == f"{TABLE}_default" for p in partitions)
    assert all(p.name.startswith(f"{TABLE}_p") for p in partitions if not p.is_default)
    assert relkind(f"{TABLE}_unpartitioned") == ("r" if keep_old else None)
    assert execute(f"SELECT count(*) FROM pg_trigger WHERE tgrelid = to_regclass('{TABLE}_unpartitioned') "
                   f"AND NOT tgisinternal") in ([(0,)], [(None,)])


def test_concurrent_writers_lose_nothing(session_table):
    ledger = Ledger({})
    session_table(20_000)
    ledger.rows.update(table_rows())
    lines: list[str] = []
    with Writers(ledger) as writers:
        time.sleep(0.3)
        started = time.time()
        report = convert_to_partitioned(TABLE, "created_at", policy=POLICY, batch_rows=500, progress=lines.append,
                                        pacer=Pacer(0))
        finished = time.time()
        time.sleep(0.3)  # and after the swap, through the same name
    assert writers.errors == []
    during = [t for t in writers.commits if started <= t <= finished]
    assert len(during) > 50, "the writers must have written while the table was converted"
    assert any(t > finished for t in writers.commits)
    assert report.phase == "swapped" and not report.nothing_to_do
    assert report.rows_copied >= 15_000 and report.rows > 0
    assert table_rows() == ledger.expected()
    assert_converted(keep_old=True)
    assert any("copied" in line for line in lines) and any("verified" in line for line in lines)
    # 10 days of rows, the current bin and 2 ahead, plus the rows the writers sent to DEFAULT
    assert len(catalog.range_partitions(TABLE)) >= 11
    assert execute(f"SELECT count(*) > 0 FROM {TABLE}_default")[0][0]


@pytest.mark.parametrize("drop_old", [False, True])
def test_crash_at_every_phase_resumes_and_loses_nothing(session_table, drop_old):
    ledger = Ledger({})
    session_table(3_000)
    ledger.rows.update(table_rows())
    batches = []

    def crash_at(point: str):
        def hook(reached: str) -> None:
            if reached == "batch":
                batches.append(reached)
            if reached == point and (point != "batch" or len(batches) % 3 == 2):
                raise Crash(point)
        return hook

    run = dict(policy=POLICY, batch_rows=400, progress=lambda _: None, pacer=Pacer(0), drop_old=drop_old)
    with Writers(ledger, threads=2) as writers:
        for point in ("prepared", "armed", "batch", "batch", "copied", "verified", "swap"):
            with pytest.raises(Crash):
                convert_to_partitioned(TABLE, "created_at", crash_at=crash_at(point), **run)
            state = conversion_state(TABLE)
            assert relkind(TABLE) == "r", f"nothing swapped yet after a crash at {point}"
            if point == "batch":
                assert state.phase == "copying" and state.last_key and state.rows_copied >= 400
            if point == "swap":
                assert state.phase == "verified"
            time.sleep(0.1)  # writers write between the crash and the rerun
        report = convert_to_partitioned(TABLE, "created_at", **run)
        time.sleep(0.1)
    assert writers.errors == []
    assert report.phase == ("dropped" if drop_old else "swapped")
    assert report.rows and report.checksum
    assert table_rows() == ledger.expected()
    assert_converted(keep_old=not drop_old)
    assert convert_to_partitioned(TABLE, "created_at", **run).nothing_to_do


def test_empty_table_is_quick(session_table):
    session_table(0)
    started = time.perf_counter()
    report = convert_to_partitioned(TABLE, "created_at", policy=POLICY, progress=lambda _: None)
    seconds = time.perf_counter() - started
    assert seconds < 1.5, f"an empty table took {seconds:.2f} s (every fresh test database runs this)"
    assert report.phase == "swapped" and report.rows == 0
    assert_converted()
    assert len(catalog.range_partitions(TABLE)) == POLICY.premake + 1
    execute(f"INSERT INTO {TABLE} VALUES (gen_random_uuid(), 1, now(), now(), 'queued', 0, '')")
    assert execute(f"SELECT count(*) FROM {TABLE}_default") == [(0,)]


def test_partitioned_table_is_a_fast_no_op(session_table):
    execute("CREATE TABLE conv_parted (id uuid, created_at timestamptz NOT NULL, PRIMARY KEY (id, created_at)) "
            "PARTITION BY RANGE (created_at)")
    started = time.perf_counter()
    report = convert_to_partitioned("conv_parted", "created_at", policy=POLICY)
    assert report.nothing_to_do and time.perf_counter() - started < 0.5
    out = io.StringIO()
    call_command("partition_table", "conv_parted", "--column", "created_at", stdout=out)
    assert "nothing to do" in out.getvalue()


def test_mistakes_are_refused(session_table):
    session_table(10)
    with pytest.raises(TableConversionError, match="no table named conv_nope"):
        convert_to_partitioned("conv_nope", "created_at", policy=POLICY)
    with pytest.raises(TableConversionError, match="has no column started"):
        convert_to_partitioned(TABLE, "started", policy=POLICY)
    with pytest.raises(TableConversionError, match="not timestamp with time zone"):
        convert_to_partitioned(TABLE, "status", policy=POLICY)
    execute(f"CREATE TABLE conv_ref (session_id uuid REFERENCES {TABLE} (id))")
    with pytest.raises(TableConversionError, match=r"referenced by foreign keys \(conv_ref\."):
        convert_to_partitioned(TABLE, "created_at", policy=POLICY)
    assert relkind(f"{TABLE}_partitioned") is None, "nothing is made for a refused table"
    with pytest.raises(CommandError, match=r"^partition_table conv_nope: no table named conv_nope$"):
        call_command("partition_table", "conv_nope", "--column", "created_at")
    with pytest.raises(CommandError, match="has no column started"):
        call_command("partition_table", TABLE, "--column", "started")


def test_command_converts_and_reports_status(session_table):
    session_table(1_000)
    out = io.StringIO()
    call_command("partition_table", TABLE, "--column", "created_at", "--status", stdout=out)
    assert "not partitioned; no conversion recorded" in out.getvalue()
    call_command("partition_table", TABLE, "--column", "created_at", "--batch-rows", "300", "--drop-old", stdout=out)
    assert "dropped" in out.getvalue() and relkind(TABLE) == "p" and relkind(f"{TABLE}_unpartitioned") is None
    out = io.StringIO()
    call_command("partition_table", TABLE, "--column", "created_at", "--status", stdout=out)
    assert "partitioned; conversion on created_at is dropped" in out.getvalue()
    assert execute(f"SELECT count(*) FROM {TABLE}") == [(1_000,)]
