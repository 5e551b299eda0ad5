"""Fall back to the primary when a replica fails in the middle of a read.

The router picks a database before the query runs, from a health snapshot up to one probe
interval old, so a replica that has just gone away can still be picked. Reads made through
``read_routed`` catch the connection error, mark the replica down for the rest of the probe
interval and run again on the primary; whole API requests get the same treatment from
``metadata.replicas.middleware`` (safe methods only).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from django.db import DatabaseError, InterfaceError, OperationalError, connections

from metadata.replicas import lsn
from metadata.replicas.health import replica_health
from metadata.replicas.router import ReadRoute, route_read

logger = logging.getLogger(__name__)
T = TypeVar("T")

# What a lost or refused connection raises through Django (psycopg's errors, wrapped).
REPLICA_ERRORS: tuple[type[Exception], ...] = (OperationalError, InterfaceError)


def abandon_replica(alias: str, exc: BaseException) -> None:
    """Stop using ``alias`` until the next probe and give its broken connection back."""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    replica_health().mark_down(alias, reason)
    try:
        connections[alias].close()  # the pool discards a broken connection instead of reusing it
    except DatabaseError:
        pass


def read_routed(read: Callable[[str], T], min_lsn: int = lsn.NO_LSN) -> tuple[T, ReadRoute]:
    """Run ``read(alias)`` where the router says; on a replica failure, again on the primary."""
    route = route_read(min_lsn)
    try:
        result = read(route.alias)
    except REPLICA_ERRORS as exc:
        if not route.on_replica:
            raise
        logger.warning("read on %s failed, retrying on the primary: %s", route.alias, exc)
        abandon_replica(route.alias, exc)
        with lsn.primary_only():
            route = route_read(min_lsn)
        result = read(route.alias)
    lsn.note_served_by(route.alias)
    return result, route


def replicas_used() -> list[str]:
    """Replica aliases that served reads in the current floor scope (a request, a task)."""
    return [alias for alias in lsn.served_by() if alias in replica_health().aliases]
