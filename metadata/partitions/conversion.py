"""Turn a live unpartitioned table into a RANGE-partitioned one without a long lock; resumable.

``convert_to_partitioned(table, column)`` builds a partitioned *shadow* ``<table>_partitioned``
next to the live table, keeps it in step with every write, copies the existing rows into it in
committed batches, verifies both tables in one snapshot and swaps the names in one short
transaction. Phases, recorded in ``metadata_table_conversion`` (made by the tool itself) so a rerun
goes on from where a crash stopped::

    prepared   shadow made: LIKE the source (defaults, CHECKs, NOT NULLs), PARTITION BY RANGE
               (column), primary key = source PK + column, DEFAULT partition ``<table>_default``,
               a partition per bin holding rows plus the current bin and ``premake`` ahead
               (``bounds.partition_name``, so the rotation manages them later), every other index
               of the source (``pg_get_indexdef``, under a temporary name), its FOREIGN KEYs
    armed      a row trigger on the source mirrors INSERT/UPDATE/DELETE (and TRUNCATE) into the
               shadow as an upsert or a delete, in the writer's own transaction
    copying    rows copied in keyset batches over the PK, up to the largest key that existed
               once the trigger was in place (``copy_until``); ``last_key`` and ``rows_copied``
               are committed with each batch
    copied     every batch done
    verified   count and checksum of both tables equal, taken in ONE REPEATABLE READ snapshot
    swapped    one transaction under ``lock_timeout`` (retried): ACCESS EXCLUSIVE on both, drop
               the trigger, source -> ``<table>_unpartitioned``, shadow -> ``<table>``, and the
               shadow's PK and indexes take the source's names (Django's state still matches)
    dropped    ``<table>_unpartitioned`` dropped (``drop_old``)

Why no write is lost or left stale (the trigger fires in the writer's transaction, so a source
change and its mirror commit or roll back together; every snapshot sees both or neither):

* Arming. ``CREATE TRIGGER`` takes SHARE ROW EXCLUSIVE on the source, so it waits for every
  transaction that has written to it and blocks new writes until it commits; a write is either
  committed before the trigger exists (then the copy, whose batches take snapshots after, sees
  it) or made after (then the trigger mirrors it). A transaction that only read the source before
  and writes after takes a stronger lock for the write and reloads the table's triggers then.
* ``copy_until`` is read after arming, so every row with a larger key, and every row that is not
  visible then, was written with the trigger in place: the copy never has to chase writers.
* A batch is a key range ``(last_key, end]``, ``end`` being the key ``n`` rows on (read first,
  unlocked, so the cursor never depends on what the lock finds), then ``SELECT ... WHERE pk in
  that range FOR SHARE`` feeding ``INSERT ... ON CONFLICT DO NOTHING``. FOR SHARE makes a
  concurrent UPDATE or DELETE of a row in the batch wait until the batch commits; its trigger
  then upserts the newer version over the copy, or deletes it. A writer that locked a row first
  makes the batch wait; READ COMMITTED then re-reads the row's newest version (or skips it if
  deleted) and the batch copies that version, which the writer's trigger has already put in the
  shadow, so DO NOTHING keeps the same row.
* A row inserted behind the cursor (random UUIDs) or ahead of it arrives through the trigger; the
  copy reaching it later does nothing (the conflict). A key or partition-key change is a delete
  of the old key and an upsert of the new one. A row deleted before the copy reaches it is gone
  from both. The shadow's key (source PK + column) is wider than the source's, so its conflicts
  are exactly the source's.
* Deadlocks: a batch waits on a writer's row lock and the writer then on a row the batch locked.
  Batches run under the maintenance ``lock_timeout`` (500 ms by default), shorter than
  ``deadlock_timeout`` (1 s by default; keep it so): the batch gives up first and is retried, so
  the deadlock detector never picks the application's transaction.
* A row whose primary key changes while the batch waits for it leaves or enters the range; its
  new version came through the trigger either way, and the next range starts at ``end`` whatever
  the batch locked (a cursor taken from the locked rows could jump past unread rows). The copy
  ends with the range that ends at ``copy_until``.
* Swap: writers queue behind ACCESS EXCLUSIVE for milliseconds; a statement that waited re-reads
  the name after the lock, so it writes to the new table without an error. The verification
  needs no lock: both tables are in step in any snapshot.

Refused, with a message: another table's (or its own) FOREIGN KEY points at the table, views
depend on it, identity or generated columns, a nullable or non-timestamptz partition column, a
unique index that lacks the partition column. Indexes added to the source during the copy are
built on the shadow (per partition, concurrently, attached ``ON ONLY``) before verification;
indexes dropped from it are dropped from the shadow.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.utils import timezone

from metadata.partitions import catalog
from metadata.partitions.bounds import BIN_ORIGIN, TimeRange, bin_start, bins, partition_name
from metadata.partitions.errors import PartitionError
from metadata.partitions.locks import advisory_lock, autocommit_with_lock_retries, literal, quote, with_lock_retries
from metadata.partitions.pacing import Pacer
from metadata.partitions.policy import PartitionPolicy

logger = logging.getLogger(__name__)

STATE_TABLE = "metadata_table_conversion"
TABLE_CONVERSION_LOCK = 0x5350_4543_0003  # "SPEC" + 3: one conversion at a time (partitions are 1 and 2)
_JSON_FIELDS = ("index_names", "copy_until", "last_key")
PHASES = ("prepared", "armed", "copying", "copied", "verified", "swapped", "dropped")
CrashPoint = Callable[[str], None]  # called with "prepared", "armed", "batch", "copied", "verified",
# "swap" (inside the swap's transaction, after the renames) and "swapped"; tests raise from it

_STATE_DDL = f"""
CREATE TABLE IF NOT EXISTS {STATE_TABLE} (
    source_table text PRIMARY KEY,
    partition_column text NOT NULL,
    shadow_table text NOT NULL,
    old_table text NOT NULL,
    phase text NOT NULL,
    index_names jsonb NOT NULL DEFAULT '{{}}',
    copy_until jsonb,
    last_key jsonb,
    rows_copied bigint NOT NULL DEFAULT 0,
    source_rows bigint,
    source_checksum text,
    shadow_rows bigint,
    shadow_checksum text,
    started_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
)"""


class TableConversionError(PartitionError):
    """The table cannot be converted as it is, or the copy does not match the source."""


class _IndexesChanged(Exception):
    """The source's indexes changed after the shadow's were made to match (retried)."""


@dataclass(frozen=True)
class SourceShape:
    """What the conversion needs to know about the source table, read from pg_catalog."""

    table: str
    column: str
    columns: list[str]
    types: dict[str, str]
    pk: list[str]
    pk_index: str
    indexes: dict[str, str]  # name -> CREATE INDEX statement (PK excluded)
    foreign_keys: dict[str, str]  # name -> constraint definition


@dataclass
class ConversionState:
    """One row of ``metadata_table_conversion``."""

    source_table: str
    partition_column: str
    shadow_table: str
    old_table: str
    phase: str
    index_names: dict[str, str]  # shadow index -> the source's name it takes at the swap
    copy_until: list[str] | None
    last_key: list[str] | None
    rows_copied: int
    source_rows: int | None
    source_checksum: str | None
    shadow_rows: int | None
    shadow_checksum: str | None
    started_at: dt.datetime
    updated_at: dt.datetime


@dataclass
class ConversionReport:
    table: str
    column: str
    phase: str
    nothing_to_do: bool = False
    rows_copied: int = 0
    partitions: list[str] = field(default_factory=list)
    rows: int | None = None
    checksum: str | None = None
    old_table: str | None = None
    seconds: float = 0.0

    def summary(self) -> str:
        if self.nothing_to_do:
            return f"{self.table} is already partitioned: nothing to do"
        kept = f", old rows kept in {self.old_table}" if self.old_table else ""
        return (f"{self.table}: {self.phase}; {self.rows} row(s) verified (checksum {str(self.checksum)[:12]}), "
                f"{self.rows_copied} copied in batches in {self.seconds:.1f} s{kept}")


def convert_to_partitioned(table: str, column: str, *, policy: PartitionPolicy | None = None,
                           batch_rows: int = 5000, progress: Callable[[str], None] | None = None,
                           using: str = DEFAULT_DB_ALIAS, drop_old: bool = False,
                           pacer: Pacer | None = None, crash_at: CrashPoint | None = None) -> ConversionReport:
    """Convert ``table`` into a table RANGE-partitioned on ``column`` (see the module docstring).

    Idempotent: a partitioned ``table`` is a no-op (``nothing_to_do``), an interrupted run resumes.
    Call outside a transaction (in a migration: ``RunPython(..., atomic=False)``).
    """
    converter = TableConverter(table, column, policy=policy or PartitionPolicy.from_settings(),
                               batch_rows=batch_rows, progress=progress or logger.info, using=using,
                               pacer=pacer, crash_at=crash_at)
    return converter.run(drop_old=drop_old)


def conversion_state(table: str, using: str = DEFAULT_DB_ALIAS) -> ConversionState | None:
    """The recorded conversion of ``table`` (None if none was ever started)."""
    if not catalog.relation_exists(STATE_TABLE, using):
        return None
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT * FROM {STATE_TABLE} WHERE source_table = %s", [table])
        row = cursor.fetchone()
        if row is None:
            return None
        names = [d[0] for d in cursor.description]
    values = dict(zip(names, row, strict=True))
    for key in _JSON_FIELDS:
        if isinstance(values[key], str):
            values[key] = json.loads(values[key])
    return ConversionState(**values)


def relkind(table: str, using: str = DEFAULT_DB_ALIAS) -> str | None:
    """``r`` (plain table), ``p`` (partitioned), another kind, or None when there is no such relation."""
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [quote(table, using)])
        row = cursor.fetchone()
    return row[0] if row else None


class TableConverter:
    """One table's conversion: each phase a method, each safe to rerun after a crash."""

    def __init__(self, table: str, column: str, policy: PartitionPolicy, batch_rows: int,
                 progress: Callable[[str], None], using: str = DEFAULT_DB_ALIAS,
                 pacer: Pacer | None = None, crash_at: CrashPoint | None = None) -> None:
        if batch_rows < 1:
            raise TableConversionError("batch_rows must be at least 1")
        self.table, self.column, self.policy, self.batch_rows = table, column, policy, batch_rows
        self.progress, self.using = progress, using
        self.pacer = pacer or Pacer()
        self.crash_at = crash_at or (lambda point: None)
        self.shadow = f"{table[:51]}_partitioned"
        self.old = f"{table[:49]}_unpartitioned"
        self.default = f"{table[:55]}_default"
        self.function = f"{table[:40]}_conversion_mirror"
        self.trigger = self.function
        self.partitions: list[str] = []

    # ---------------------------------------------------------------- the run
    def run(self, drop_old: bool = False) -> ConversionReport:
        started = time.perf_counter()
        if connections[self.using].in_atomic_block:
            raise TableConversionError("convert_to_partitioned commits in batches: call it outside a transaction")
        kind = relkind(self.table, self.using)
        if kind is None:
            raise TableConversionError(f"no table named {self.table}")
        if self.column not in catalog.table_columns(quote(self.table), self.using):
            raise TableConversionError(f"{self.table} has no column {self.column}")
        if kind == "p":
            return self._finish(drop_old, started, converted=False)
        if kind != "r":
            raise TableConversionError(f"{self.table} is not a plain table (relkind {kind!r})")
        shape = self.shape()
        with advisory_lock(TABLE_CONVERSION_LOCK, self.using):
            self._execute(_STATE_DDL)
            self._convert(shape)
        return self._finish(drop_old, started, converted=True)

    def _convert(self, shape: SourceShape) -> None:
        state = conversion_state(self.table, self.using)
        if state is not None and state.phase in ("swapped", "dropped"):  # a new table of the same name
            self._execute(f"DELETE FROM {STATE_TABLE} WHERE source_table = %s", [self.table])
            state = None
        if state is None:
            self._check_names_free()
            self._prepare(shape)
            state = self._state()
        if state.phase == "prepared":
            self._arm(shape)
            state = self._state()
        if state.phase in ("armed", "copying"):
            self._copy(shape, state)
            state = self._state()
        for _ in range(3):  # indexes changed on the source between the sync and the swap's lock: again
            if state.phase == "copied":
                self._sync_indexes(shape, state)
                self._verify(shape)
                state = self._state()
            try:
                self._swap(shape, state)
                return
            except _IndexesChanged:
                self._set_state(phase="copied")
                state = self._state()
        raise TableConversionError(f"the indexes of {self.table} keep changing: rerun later")

    def _finish(self, drop_old: bool, started: float, converted: bool) -> ConversionReport:
        state = conversion_state(self.table, self.using)
        dropped = False
        if drop_old and state is not None and state.phase == "swapped":
            with_lock_retries(lambda: self._drop_old(state), f"drop {state.old_table}", self.using)
            self.progress(f"{self.table}: dropped {state.old_table}")
            state, dropped = self._state(), True
        if state is None or not (converted or dropped):
            return ConversionReport(self.table, self.column, state.phase if state else "partitioned",
                                    nothing_to_do=True, seconds=time.perf_counter() - started)
        return ConversionReport(
            self.table, self.column, state.phase, rows_copied=state.rows_copied, partitions=self.partitions,
            rows=state.source_rows, checksum=state.source_checksum,
            old_table=state.old_table if state.phase == "swapped" else None, seconds=time.perf_counter() - started)

    # ---------------------------------------------------------------- the source
    def shape(self) -> SourceShape:
        """Read the source's columns, key, indexes and foreign keys; refuse what cannot be converted."""
        rows = self._fetch(
            "SELECT attname, format_type(atttypid, atttypmod), attnotnull, attidentity, attgenerated "
            "FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            [quote(self.table)])
        types = {name: kind for name, kind, _, _, _ in rows}
        if self.column not in types:
            raise TableConversionError(f"{self.table} has no column {self.column}")
        odd = [name for name, _, _, identity, generated in rows if identity or generated]
        if odd:
            raise TableConversionError(
                f"{self.table}: identity or generated columns are not supported ({', '.join(odd)})")
        if types[self.column] != "timestamp with time zone":
            raise TableConversionError(
                f"{self.table}.{self.column} is {types[self.column]}, not timestamp with time zone")
        if not next(notnull for name, _, notnull, _, _ in rows if name == self.column):
            raise TableConversionError(f"{self.table}.{self.column} must be NOT NULL to be a partition key")
        pk = self._fetch(
            "SELECT i.relname, array(SELECT a.attname FROM unnest(c.conkey) WITH ORDINALITY k(n, o) "
            "JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.n ORDER BY k.o) "
            "FROM pg_constraint c JOIN pg_class i ON i.oid = c.conindid WHERE c.conrelid = to_regclass(%s) "
            "AND c.contype = 'p'", [quote(self.table)])
        if not pk:
            raise TableConversionError(f"{self.table} has no primary key to copy it by")
        self._refuse_dependents()
        return SourceShape(self.table, self.column, list(types), types, list(pk[0][1]), pk[0][0],
                           self._indexes(self.table), self._foreign_keys())

    def _refuse_dependents(self) -> None:
        referencing = self._fetch(
            "SELECT conrelid::regclass::text, conname FROM pg_constraint WHERE contype = 'f' "
            "AND confrelid = to_regclass(%s) ORDER BY 1, 2", [quote(self.table)])
        if referencing:
            named = ", ".join(f"{t}.{c}" for t, c in referencing)
            raise TableConversionError(f"{self.table} is referenced by foreign keys ({named}): drop them first")
        views = self._fetch(
            "SELECT DISTINCT r.ev_class::regclass::text FROM pg_depend d JOIN pg_rewrite r ON r.oid = d.objid "
            "WHERE d.classid = 'pg_rewrite'::regclass AND d.refobjid = to_regclass(%s) "
            "AND r.ev_class <> d.refobjid ORDER BY 1", [quote(self.table)])
        if views:
            raise TableConversionError(
                f"views depend on {self.table} ({', '.join(v for (v,) in views)}): drop them first")

    def _indexes(self, table: str) -> dict[str, str]:
        """Valid non-PK indexes of ``table``: name -> definition (``CREATE ... INDEX name ON tbl ...``)."""
        rows = self._fetch(
            "SELECT c.relname, pg_get_indexdef(x.indexrelid), x.indisunique, "
            "  %s = ANY(array(SELECT attname FROM pg_attribute WHERE attrelid = x.indrelid AND attnum = ANY(x.indkey))) "
            "FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid "
            "WHERE x.indrelid = to_regclass(%s) AND NOT x.indisprimary AND x.indisvalid ORDER BY c.relname",
            [self.column, quote(table)])
        for name, _, unique, has_column in rows:
            if unique and not has_column:
                raise TableConversionError(
                    f"unique index {name} lacks {self.column}: a partitioned table cannot enforce it")
        return {name: definition for name, definition, _, _ in rows}

    def _foreign_keys(self) -> dict[str, str]:
        rows = self._fetch(
            "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = to_regclass(%s) AND contype = 'f' ORDER BY conname", [quote(self.table)])
        return dict(rows)

    def _check_names_free(self) -> None:
        for name in (self.shadow, self.old, self.default):
            if catalog.relation_exists(name, self.using):
                raise TableConversionError(f"{name} already exists: rename or drop it before converting {self.table}")

    # ---------------------------------------------------------------- prepared
    def _prepare(self, shape: SourceShape) -> None:
        """Make the shadow with its partitions, indexes and FKs, and the state row, in one transaction."""
        col = quote(self.column)
        wanted = self._bins()

        def prepare() -> None:
            self.partitions = []
            self._execute(f"CREATE TABLE {quote(self.shadow)} (LIKE {quote(self.table)} INCLUDING DEFAULTS "
                          f"INCLUDING CONSTRAINTS) PARTITION BY RANGE ({col})")
            key = shape.pk + ([] if self.column in shape.pk else [self.column])
            names = {self._temporary_name(shape.pk_index): shape.pk_index}
            pk_name = next(iter(names))
            self._execute(f"ALTER TABLE {quote(self.shadow)} ADD CONSTRAINT {quote(pk_name)} "
                          f"PRIMARY KEY ({', '.join(quote(c) for c in key)})")
            self._execute(f"CREATE TABLE {quote(self.default)} PARTITION OF {quote(self.shadow)} DEFAULT")
            for bounds in wanted:
                name = catalog.free_name(partition_name(self.table, bounds), self.using)
                self._execute(f"CREATE TABLE {quote(name)} PARTITION OF {quote(self.shadow)} "
                              f"FOR VALUES FROM ({literal(bounds.start)}) TO ({literal(bounds.end)})")
                self.partitions.append(name)
            for name, definition in shape.indexes.items():
                temporary = self._temporary_name(name)
                self._execute(self._retarget(definition, name, temporary, self.table, self.shadow))
                names[temporary] = name
            for name, definition in shape.foreign_keys.items():
                self._execute(f"ALTER TABLE {quote(self.shadow)} ADD CONSTRAINT {quote(name)} {definition}")
            self._execute(
                f"INSERT INTO {STATE_TABLE} (source_table, partition_column, shadow_table, old_table, phase, "
                f"index_names) VALUES (%s, %s, %s, %s, 'prepared', %s)",
                [self.table, self.column, self.shadow, self.old, json.dumps(names)])

        with_lock_retries(prepare, f"prepare {self.shadow}", self.using)
        self.progress(f"{self.table}: made {self.shadow} with {len(self.partitions)} partition(s) and "
                      f"{self.default}, {len(shape.indexes)} index(es), {len(shape.foreign_keys)} foreign key(s)")
        self.crash_at("prepared")

    def _bins(self) -> list[TimeRange]:
        """The bins holding rows now, the current bin and ``premake`` bins ahead."""
        width = self.policy.interval
        rows = self._fetch(f"SELECT DISTINCT date_bin(%s, {quote(self.column)}, %s) FROM {quote(self.table)}",
                           [width, BIN_ORIGIN])
        wanted = {TimeRange(start, start + width) for (start,) in rows}
        current = bin_start(timezone.now(), width)
        wanted.update(bins(current, current + width * (self.policy.premake + 1), width))
        return sorted(wanted)

    def _temporary_name(self, name: str) -> str:
        return catalog.free_name(f"{name[:56]}_shadow", self.using)

    def _retarget(self, definition: str, name: str, new_name: str, table: str, new_table: str) -> str:
        """``CREATE INDEX name ON public.table USING ...`` -> the same on ``new_table`` as ``new_name``."""
        qualified = self._fetch("SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) FROM pg_class c "
                                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass(%s)",
                                [quote(table)])[0][0]
        pattern = (r"^CREATE (UNIQUE )?INDEX " + re.escape(self._fetch("SELECT quote_ident(%s)", [name])[0][0])
                   + r" ON (ONLY )?" + re.escape(qualified) + r" USING ")
        match = re.match(pattern, definition)
        if not match:
            raise TableConversionError(f"cannot read the definition of index {name}: {definition}")
        head = f"CREATE {match.group(1) or ''}INDEX {quote(new_name)} ON {quote(new_table)} USING "
        return head + definition[match.end():]

    # ---------------------------------------------------------------- armed
    def _arm(self, shape: SourceShape) -> None:
        """The mirror trigger, created under lock_timeout (it waits for the source's writers)."""
        function_sql = self._mirror_function(shape)

        def arm() -> None:
            self._execute(function_sql)
            self._execute(f"CREATE OR REPLACE FUNCTION {quote(self.function + '_t')}() RETURNS trigger "
                          f"LANGUAGE plpgsql AS $$ BEGIN TRUNCATE {quote(self.shadow)}; RETURN NULL; END $$")
            self._execute(f"DROP TRIGGER IF EXISTS {quote(self.trigger)} ON {quote(self.table)}")
            self._execute(f"DROP TRIGGER IF EXISTS {quote(self.trigger + '_t')} ON {quote(self.table)}")
            self._execute(f"CREATE TRIGGER {quote(self.trigger)} AFTER INSERT OR UPDATE OR DELETE ON "
                          f"{quote(self.table)} FOR EACH ROW EXECUTE FUNCTION {quote(self.function)}()")
            self._execute(f"CREATE TRIGGER {quote(self.trigger + '_t')} AFTER TRUNCATE ON {quote(self.table)} "
                          f"FOR EACH STATEMENT EXECUTE FUNCTION {quote(self.function + '_t')}()")
            self._set_state(phase="armed")

        with_lock_retries(arm, f"arm the mirror trigger on {self.table}", self.using)
        self.progress(f"{self.table}: writes now mirrored into {self.shadow}")
        self.crash_at("armed")

    def _mirror_function(self, shape: SourceShape) -> str:
        key = shape.pk + ([] if self.column in shape.pk else [self.column])
        cols = ", ".join(quote(c) for c in shape.columns)
        new = ", ".join(f"NEW.{quote(c)}" for c in shape.columns)
        match_old = " AND ".join(f"{quote(c)} = OLD.{quote(c)}" for c in key)
        changed = " OR ".join(f"OLD.{quote(c)} IS DISTINCT FROM NEW.{quote(c)}" for c in key)
        rest = [c for c in shape.columns if c not in key]
        upsert = (f"DO UPDATE SET {', '.join(f'{quote(c)} = EXCLUDED.{quote(c)}' for c in rest)}" if rest
                  else "DO NOTHING")
        shadow = quote(self.shadow)
        return f"""CREATE OR REPLACE FUNCTION {quote(self.function)}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' OR (TG_OP = 'UPDATE' AND ({changed})) THEN
        DELETE FROM {shadow} WHERE {match_old};
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN NULL;
    END IF;
    INSERT INTO {shadow} ({cols}) VALUES ({new})
        ON CONFLICT ({', '.join(quote(c) for c in key)}) {upsert};
    RETURN NULL;
END $$"""

    # ---------------------------------------------------------------- copying
    def _copy(self, shape: SourceShape, state: ConversionState) -> None:
        """Copy the rows up to ``copy_until`` in committed keyset batches (see the module docstring)."""
        pk = ", ".join(quote(c) for c in shape.pk)
        if state.phase == "armed":  # read after the trigger is in place, never before
            bound = self._fetch(f"SELECT ARRAY[{self._key_text(shape)}] FROM {quote(self.table)} "
                                f"ORDER BY {pk} DESC LIMIT 1")
            state.copy_until = list(bound[0][0]) if bound else None
            self._set_state(phase="copying" if bound else "copied", copy_until=json.dumps(state.copy_until))
            if not bound:
                return
        cols = ", ".join(quote(c) for c in shape.columns)
        last, copied = state.last_key, state.rows_copied
        reported = time.perf_counter()
        self.progress(f"{self.table}: copying into {self.shadow} from "
                      f"{'the start' if last is None else 'key ' + '/'.join(last)} ({copied} row(s) so far)")
        while True:
            def one_batch() -> tuple[int, list[str]]:
                end = self._batch_end(shape, pk, last, state.copy_until)
                where, params = self._key_range(shape, pk, last, end)
                scanned = self._fetch(
                    f"WITH batch AS MATERIALIZED (SELECT {cols} FROM {quote(self.table)} WHERE {where} FOR SHARE), "
                    f"copied AS (INSERT INTO {quote(self.shadow)} ({cols}) SELECT {cols} FROM batch "
                    f"ON CONFLICT DO NOTHING RETURNING 1) SELECT (SELECT count(*) FROM batch)", params)[0][0]
                self._set_state(phase="copying", last_key=json.dumps(end), rows_copied=copied + scanned)
                return scanned, end

            scanned, last = with_lock_retries(one_batch, f"copy a batch of {self.table}", self.using)
            copied += scanned
            self.crash_at("batch")
            if last == list(state.copy_until):
                break
            self.pacer.pause()
            if time.perf_counter() - reported >= 2.0:
                self.progress(f"{self.table}: copied {copied} row(s), up to key {'/'.join(last)}")
                reported = time.perf_counter()
        self._set_state(phase="copied")
        self.progress(f"{self.table}: copied {copied} row(s) into {self.shadow}")
        self.crash_at("copied")

    def _batch_end(self, shape: SourceShape, pk: str, last: list[str] | None, until: list[str]) -> list[str]:
        """The key ``batch_rows`` rows past ``last`` (or ``until``): a batch is a key RANGE fixed before
        it is locked, so a row whose key changes under the lock cannot move the cursor past others."""
        where, params = self._key_range(shape, pk, last, until)
        found = self._fetch(f"SELECT ARRAY[{self._key_text(shape)}] FROM {quote(self.table)} WHERE {where} "
                            f"ORDER BY {pk} OFFSET {int(self.batch_rows) - 1} LIMIT 1", params)
        return list(found[0][0]) if found else list(until)

    def _key_range(self, shape: SourceShape, pk: str, after: list[str] | None, upto: list[str]) -> tuple[str, list]:
        where, params = f"({pk}) <= ({self._key_params(shape)})", list(upto)
        if after is not None:
            where, params = f"({pk}) > ({self._key_params(shape)}) AND {where}", list(after) + params
        return where, params

    def _key_text(self, shape: SourceShape) -> str:
        return ", ".join(f"{quote(c)}::text" for c in shape.pk)

    def _key_params(self, shape: SourceShape) -> str:
        return ", ".join(f"%s::{shape.types[c]}" for c in shape.pk)

    # ---------------------------------------------------------------- verified
    def _sync_indexes(self, shape: SourceShape, state: ConversionState) -> None:
        """Follow index changes made to the source since preparation (a rebuilt partial index, say)."""
        wanted = self._indexes(self.table)
        have = {original: temporary for temporary, original in state.index_names.items()
                if original != shape.pk_index}
        for original in sorted(set(have) - set(wanted)):
            self._execute(f"DROP INDEX IF EXISTS {quote(have[original])}")
            del state.index_names[have[original]]
        for original in sorted(set(wanted) - set(have)):
            temporary = self._temporary_name(original)
            self._build_on_partitions(self._retarget(wanted[original], original, temporary, self.table, self.shadow),
                                      temporary)
            state.index_names[temporary] = original
        if set(wanted) != set(have):
            self._set_state(index_names=json.dumps(state.index_names))
            self.progress(f"{self.table}: indexes of {self.shadow} follow the source's ({len(wanted)})")

    def _build_on_partitions(self, definition: str, name: str) -> None:
        """A parent index ``ON ONLY`` the shadow, each partition's built concurrently and attached."""
        on_only = definition.replace(f" ON {quote(self.shadow)} USING ", f" ON ONLY {quote(self.shadow)} USING ", 1)
        self._execute(on_only)
        for n, partition in enumerate(catalog.list_partitions(self.shadow, self.using)):
            part_index = catalog.free_name(f"{name[:54]}_p{n}", self.using)
            statement = definition.replace(f"INDEX {quote(name)} ON {quote(self.shadow)} USING ",
                                           f"INDEX CONCURRENTLY {quote(part_index)} ON {quote(partition.name)} USING ", 1)
            autocommit_with_lock_retries(statement, f"build {part_index}", self.using)
            self._execute(f"ALTER INDEX {quote(name)} ATTACH PARTITION {quote(part_index)}")

    def _verify(self, shape: SourceShape) -> None:
        """Count and checksum both tables in one REPEATABLE READ snapshot."""
        from metadata.archival.files import table_checksum  # deferred: archival imports this package

        started = time.perf_counter()
        with transaction.atomic(using=self.using):
            self._execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            source = table_checksum(self.table, shape.columns, self.using)
            shadow = table_checksum(self.shadow, shape.columns, self.using)
        self._set_state(source_rows=source[0], source_checksum=source[1], shadow_rows=shadow[0],
                        shadow_checksum=shadow[1])
        if source != shadow:
            raise TableConversionError(
                f"{self.shadow} does not match {self.table}: {shadow[0]} rows, checksum {shadow[1][:12]} vs "
                f"{source[0]} rows, {source[1][:12]}; nothing swapped (rerun to verify again)")
        self._set_state(phase="verified")
        self.progress(f"{self.table}: verified {source[0]} row(s), checksum {source[1][:12]}, "
                      f"in {time.perf_counter() - started:.1f} s")
        self.crash_at("verified")

    # ---------------------------------------------------------------- swapped
    def _swap(self, shape: SourceShape, state: ConversionState) -> None:
        """Lock both, drop the trigger, rename tables and indexes: one short transaction, retried."""
        mirrored = {original for original in state.index_names.values() if original != shape.pk_index}

        def swap() -> None:
            self._execute(f"LOCK TABLE {quote(self.table)}, {quote(self.shadow)} IN ACCESS EXCLUSIVE MODE")
            if set(self._indexes(self.table)) != mirrored:
                raise _IndexesChanged()
            self._execute(f"DROP TRIGGER IF EXISTS {quote(self.trigger)} ON {quote(self.table)}")
            self._execute(f"DROP TRIGGER IF EXISTS {quote(self.trigger + '_t')} ON {quote(self.table)}")
            self._execute(f"DROP FUNCTION IF EXISTS {quote(self.function)}()")
            self._execute(f"DROP FUNCTION IF EXISTS {quote(self.function + '_t')}()")
            for original in sorted(state.index_names.values()):
                if catalog.relation_exists(original, self.using):
                    self._execute(f"ALTER INDEX {quote(original)} RENAME TO "
                                  f"{quote(catalog.free_name(f'{original[:49]}_unpartitioned', self.using))}")
            self._execute(f"ALTER TABLE {quote(self.table)} RENAME TO {quote(self.old)}")
            self._execute(f"ALTER TABLE {quote(self.shadow)} RENAME TO {quote(self.table)}")
            for temporary, original in sorted(state.index_names.items()):
                self._execute(f"ALTER INDEX {quote(temporary)} RENAME TO {quote(original)}")
            self._move_sequences()
            self._set_state(phase="swapped")
            self.crash_at("swap")

        with_lock_retries(swap, f"swap {self.table} and {self.shadow}", self.using)
        self.progress(f"{self.table}: swapped; the partitioned table is {self.table}, the old one {self.old}")
        self.crash_at("swapped")

    def _move_sequences(self) -> None:
        """Sequences owned by the old table's columns (serial) now belong to the new table's."""
        owned = self._fetch(
            "SELECT d.objid::regclass::text, a.attname FROM pg_depend d JOIN pg_class s ON s.oid = d.objid "
            "JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid "
            "WHERE d.refobjid = to_regclass(%s) AND s.relkind = 'S' AND d.deptype = 'a'", [quote(self.old)])
        for sequence, column in owned:
            self._execute(f"ALTER SEQUENCE {sequence} OWNED BY {quote(self.table)}.{quote(column)}")

    def _drop_old(self, state: ConversionState) -> None:
        self._execute(f"DROP TABLE IF EXISTS {quote(state.old_table)}")
        self._set_state(phase="dropped")

    # ---------------------------------------------------------------- plumbing
    def _state(self) -> ConversionState:
        state = conversion_state(self.table, self.using)
        if state is None:
            raise TableConversionError(f"no conversion of {self.table} is recorded")
        return state

    def _set_state(self, **changes) -> None:
        assignments = ", ".join(f"{name} = %s::jsonb" if name in _JSON_FIELDS else f"{name} = %s" for name in changes)
        self._execute(f"UPDATE {STATE_TABLE} SET {assignments}, updated_at = now() WHERE source_table = %s",
                      [*changes.values(), self.table])

    def _execute(self, statement: str, params: list | None = None) -> None:
        with connections[self.using].cursor() as cursor:
            cursor.execute(statement, params)

    def _fetch(self, statement: str, params: list | None = None) -> list[tuple]:
        with connections[self.using].cursor() as cursor:
            cursor.execute(statement, params)
            return cursor.fetchall()


__all__ = ["STATE_TABLE", "TABLE_CONVERSION_LOCK", "ConversionReport", "ConversionState", "SourceShape",
           "TableConversionError", "TableConverter", "conversion_state", "convert_to_partitioned"]
