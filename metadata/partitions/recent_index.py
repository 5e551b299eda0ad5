"""A partial index on recently active sessions, rebuilt on a schedule with a literal cutoff.

PostgreSQL refuses ``now()`` in an index predicate (it must be IMMUTABLE), so "sessions active
in the last 30 minutes" is served by ``... WHERE last_activity_at > '<cutoff literal>'`` where the
cutoff sits ``window + 2 * rotation period`` in the past: until the index after next replaces it,
every "last ``window`` minutes" query still implies the predicate. Rotation builds the new index
with ``CREATE INDEX CONCURRENTLY`` (writers keep writing), then drops the old ones
``CONCURRENTLY``; an invalid leftover of a crashed build is dropped too.

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
from metadata.partitions.errors import ConcurrentDDLInTransaction
from metadata.partitions.locks import RECENT_INDEX_LOCK, advisory_lock, literal, quote, session_connection

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
            table = quote(Session._meta.db_table, using)
            try:
                _concurrently(
                    f"CREATE INDEX CONCURRENTLY {quote(name, using)} ON {table} ({quote(COLUMN, using)}) "
                    f"WHERE {quote(COLUMN, using)} > {literal(wanted, using)}",
                    using,
                )
            except Exception:
                _drop(name, using)  # a failed concurrent build leaves an INVALID index behind
                raise
            logger.info("built %s (cutoff %s)", name, wanted.isoformat())
            current = RecentIndex(name, wanted, True)
        for other in existing_indexes(using):
            if other.name != current.name:
                _drop(other.name, using)
        return current.name


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
    _concurrently(f"DROP INDEX CONCURRENTLY IF EXISTS {quote(name, using)}", using)
    logger.info("dropped %s", name)
