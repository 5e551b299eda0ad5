"""A partial index on recently active sessions, rebuilt on a schedule with a literal cutoff.

PostgreSQL refuses ``now()`` in an index predicate (it must be IMMUTABLE), so "sessions active
in the last 30 minutes" is served by ``... WHERE last_activity_at > '<cutoff literal>'`` where the
cutoff sits ``window + 2 * rotation period`` in the past: until the index after next replaces it,
every "last ``window`` minutes" query still implies the predicate. Rotation builds the new index
with ``CREATE INDEX CONCURRENTLY`` (writers keep writing; on the partitioned sessions table one
partition at a time, each part attached to an index ``ON ONLY`` the parent), then drops the old
ones; an invalid leftover of a crashed build is dropped too.

The planner can only use the index when the query's cutoff is a constant it can compare with
the predicate, so ask with a value computed in Python (``recent_sessions``), not ``now() - ...``.
"""
from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import QuerySet
from django.utils import timezone

from metadata.conf import conf
from metadata.models import Session
from metadata.partitions import catalog
from metadata.partitions.errors import ConcurrentDDLInTransaction
from metadata.partitions.locks import (
    RECENT_INDEX_LOCK,
    advisory_lock,
    literal,
    quote,
    session_connection,
    with_lock_retries,
)

logger = logging.getLogger(__name__)

INDEX_PREFIX = "session_recent_activity_"
COLUMN = "last_activity_at"


@dataclass(frozen=True)
class RecentIndexPolicy:
    """Window the queries ask for and how often the index is rebuilt (both in minutes)."""

    window: dt.timedelta = dt.timedelta(minutes=30)
    rotate_every: dt.timedelta = dt.timedelta(minutes=10)

    @classmethod
    def from_settings(cls) -> RecentIndexPolicy:
        return cls(
            window=dt.timedelta(minutes=int(conf.RECENT_ACTIVITY_MINUTES)),
            rotate_every=dt.timedelta(minutes=int(conf.RECENT_INDEX_ROTATE_MINUTES)),
        )

    def cutoff(self, now: dt.datetime) -> dt.datetime:
        """The predicate's literal: ``window`` plus two rotation periods back, to the minute."""
        moment = now - self.window - 2 * self.rotate_every
        return moment.replace(second=0, microsecond=0)


@dataclass(frozen=True)
class RecentIndex:
    name: str
    cutoff: dt.datetime
    valid: bool


def recent_sessions(minutes: int = 30, now: dt.datetime | None = None) -> QuerySet:
    """Sessions active in the last ``minutes``: a constant cutoff, so the partial index applies."""
    since = (now or timezone.now()) - dt.timedelta(minutes=minutes)
    return Session.objects.filter(last_activity_at__gt=since)


def index_name(cutoff: dt.datetime) -> str:
    return INDEX_PREFIX + cutoff.astimezone(dt.timezone.utc).strftime("%Y%m%d%H%M")


def existing_indexes(using: str = DEFAULT_DB_ALIAS) -> list[RecentIndex]:
    """Our partial indexes on the session table, newest cutoff first (from pg_index)."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = to_regclass(%s) AND c.relname LIKE %s",
            [Session._meta.db_table, INDEX_PREFIX + "%"],
        )
        rows = cursor.fetchall()
    found = []
    for name, valid in rows:
        stamp = name[len(INDEX_PREFIX):]
        try:
            cutoff = dt.datetime.strptime(stamp, "%Y%m%d%H%M").replace(tzinfo=dt.timezone.utc)
        except ValueError:
            continue  # someone else's index that happens to share the prefix
        found.append(RecentIndex(name, cutoff, bool(valid)))
    return sorted(found, key=lambda r: r.cutoff, reverse=True)


def rotate_recent_index(
    now: dt.datetime | None = None, policy: RecentIndexPolicy | None = None, using: str = DEFAULT_DB_ALIAS
) -> str:
    """Make sure a fresh enough index exists, then drop the others; returns the index in use.

    Idempotent: when the newest valid index is younger than one rotation period it is kept.
    Raises ``MaintenanceLockBusy`` if another rotation of this index is running.
    """
    policy = policy or RecentIndexPolicy.from_settings()
    now = now or timezone.now()
    wanted = policy.cutoff(now)
    with advisory_lock(RECENT_INDEX_LOCK, using):
        current = next((i for i in existing_indexes(using) if i.valid), None)
        if current is None or current.cutoff < wanted - policy.rotate_every or current.cutoff > now:
            name = index_name(wanted)
            for stale in (i for i in existing_indexes(using) if i.name == name):  # an invalid leftover
                _drop(stale.name, using)
            try:
                _build(name, wanted, using)
            except Exception:
                _drop(name, using)  # a failed concurrent build leaves an INVALID index behind
                raise
            logger.info("built %s (cutoff %s)", name, wanted.isoformat())
            current = RecentIndex(name, wanted, True)
        for other in existing_indexes(using):
            if other.name != current.name:
                _drop(other.name, using)
        return current.name


def _build(name: str, cutoff: dt.datetime, using: str) -> None:
    """Build the index ``name`` without blocking writers.

    On a partitioned table ``CREATE INDEX CONCURRENTLY`` is refused, so the parent gets an index
    ``ON ONLY`` itself (invalid, empty), each partition its own index built concurrently, and
    each is attached; the parent's index is valid once every partition's is attached. Partitions
    made later get theirs at their ATTACH.
    """
    table = Session._meta.db_table
    column = quote(COLUMN, using)
    predicate = f"WHERE {column} > {literal(cutoff, using)}"
    partitions = [p.name for p in catalog.list_partitions(table, using)] if catalog.is_partitioned(table, using) else []
    if not partitions:
        _concurrently(f"CREATE INDEX CONCURRENTLY {quote(name, using)} ON {quote(table, using)} ({column}) {predicate}",
                      using)
        return
    with_lock_retries(lambda: _execute(f"CREATE INDEX IF NOT EXISTS {quote(name, using)} "
                                       f"ON ONLY {quote(table, using)} ({column}) {predicate}", using),
                      f"create {name} on {table}", using)
    for partition in partitions:
        child = partition_index_name(name, table, partition)
        _concurrently(f"DROP INDEX CONCURRENTLY IF EXISTS {quote(child, using)}", using)  # a crashed build's
        _concurrently(f"CREATE INDEX CONCURRENTLY {quote(child, using)} ON {quote(partition, using)} ({column}) "
                      f"{predicate}", using)
        _execute(f"ALTER INDEX {quote(name, using)} ATTACH PARTITION {quote(child, using)}", using)


def partition_index_name(name: str, table: str, partition: str) -> str:
    """One partition's part of index ``name``: ``name`` and the partition's suffix (``p20300601``,
    ``default``), so a plan that uses the part names the index (at most 63 bytes)."""
    suffix = partition[len(table) + 1:] if partition.startswith(table + "_") else partition
    return f"{name}_{suffix}"[:63]


def _execute(statement: str, using: str) -> None:
    with connections[using].cursor() as cursor:
        cursor.execute(statement)


def _concurrently(statement: str, using: str) -> None:
    """Run a ``... CONCURRENTLY`` statement in autocommit.

    No short ``lock_timeout`` here: these take SHARE UPDATE EXCLUSIVE, which writers do not
    conflict with, and their waits are for older transactions to end; timing out would only
    leave an INVALID index behind.
    """
    if connections[using].in_atomic_block:
        raise ConcurrentDDLInTransaction("index rotation uses CONCURRENTLY and cannot run inside a transaction")
    with session_connection(using) as conn, conn.cursor() as cursor:  # direct, not through PgBouncer
        cursor.execute(statement)


def _drop(name: str, using: str) -> None:
    """Drop the index ``name``: concurrently on a plain table; on a partitioned one (where
    CONCURRENTLY is refused) with its partitions' parts, under ``lock_timeout`` with retries."""
    if catalog.is_partitioned(Session._meta.db_table, using):
        with_lock_retries(lambda: _execute(f"DROP INDEX IF EXISTS {quote(name, using)}", using), f"drop {name}", using)
    else:
        _concurrently(f"DROP INDEX CONCURRENTLY IF EXISTS {quote(name, using)}", using)
    logger.info("dropped %s", name)
