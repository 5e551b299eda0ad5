"""Primary/replica routing with read-your-writes.

Writes, and reads inside ``atomic()`` on the primary (they may depend on uncommitted rows), go to
the primary. Other reads go to a replica that has replayed the caller's floor (``metadata.replicas.lsn``)
and is within the lag and latency thresholds (``metadata.replicas.health``); if none has, to the
primary. A router picks the database before the query runs, so it cannot catch a replica that
dies mid-read: ``metadata.replicas.fallback`` retries such reads on the primary.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.db import connections

from metadata.replicas import lsn
from metadata.replicas.health import replica_health


@dataclass(frozen=True, slots=True)
class ReadRoute:
    """Where a read goes, and a position its result is known to reflect.

    ``source_lsn``: the read sees every write whose floor is <= this position (a replica's replayed
    position, or a primary position read before the query). The cache stores it with the value.
    """

    alias: str
    source_lsn: int

    @property
    def on_replica(self) -> bool:
        return self.alias != lsn.PRIMARY_ALIAS


def route_read(min_lsn: int = lsn.NO_LSN) -> ReadRoute:
    """Choose the database for a read that must see the caller's writes and ``min_lsn``.

    Inside an open transaction on the primary the read stays there and its position is unknown
    (``NO_LSN``): it may see uncommitted rows, which must never be cached.
    """
    if connections[lsn.PRIMARY_ALIAS].in_atomic_block:
        return ReadRoute(lsn.PRIMARY_ALIAS, lsn.NO_LSN)
    floor = max(lsn.required_lsn(), min_lsn)
    health = replica_health()
    if health.aliases and not lsn.primary_forced():
        replica = health.pick(floor)
        if replica is not None:
            return ReadRoute(replica.alias, replica.replay_lsn)
    return primary_route(floor)


def primary_route(floor: int = lsn.NO_LSN) -> ReadRoute:
    """The primary, with the best position known before the read: the last probed one, or the
    floor the caller read before routing."""
    return ReadRoute(lsn.PRIMARY_ALIAS, max(replica_health().snapshot().primary_lsn, floor))


# Apps whose rows a browser reads right after writing them in another request, which carries no
# LSN floor (a sign-in writes its login session, the redirect reads it): read on the primary, so
# a replica that has not replayed the sign-in never sends its user back to the sign-in page.
PRIMARY_ONLY_APPS = frozenset({"sessions"})


class ReplicaRouter:
    """Django database router: see the module docstring."""

    def db_for_read(self, model, **hints) -> str:
        instance = hints.get("instance")
        if model._meta.app_label in PRIMARY_ONLY_APPS:
            alias = lsn.PRIMARY_ALIAS
        elif instance is not None and instance._state.db == lsn.PRIMARY_ALIAS:
            # Relations of a row read from (or written to) the primary are read there too: a
            # replica may not hold the rows that row points to yet.
            alias = lsn.PRIMARY_ALIAS
        elif replica_health().aliases:
            alias = route_read().alias
        else:
            alias = lsn.PRIMARY_ALIAS
        lsn.note_served_by(alias)
        return alias

    def db_for_write(self, model, **hints) -> str:
        # The primary's execute wrapper flags the write when it runs (metadata.replicas.lsn).
        return lsn.PRIMARY_ALIAS

    def allow_relation(self, obj1, obj2, **hints) -> bool:
        return True  # replicas hold the same rows as the primary

    def allow_migrate(self, db: str, app_label: str, **hints) -> bool:
        return db == lsn.PRIMARY_ALIAS
