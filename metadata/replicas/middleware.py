"""Per-request read routing: the client's floor in and out, and a retry when a replica fails.

The client sends back the ``X-SpecOps-LSN`` header it received after a write, so its next
request (to any process) reads from a replica only once that replica has replayed the write. A
safe request whose view failed because a replica went away mid-read is run once more with every
read on the primary, so the client gets its answer instead of a 500.

The header is the client's word, so its floor is bounded by the primary's position: no floor the
server handed out is above the primary's insert position, and a floor above it (forged, or from
before a failover to a primary with less WAL) is lowered to it. A floor is what the cache stamps
a value read on the primary with (``metadata.replicas.router.primary_route``); an unbounded one
would make a value read before a write look newer than the write's invalidation, and it would
survive it (``tests/metadata/read_path/test_forged_lsn.py``).
"""
from __future__ import annotations

import logging

from django.db import DatabaseError, connections
from django.http import HttpRequest, HttpResponse

from metadata.conf import conf
from metadata.replicas import lsn
from metadata.replicas.fallback import REPLICA_ERRORS, abandon_replica, replicas_used
from metadata.replicas.health import replica_health

logger = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_RETRY_ATTR = "_specops_retry_on_primary"


def client_floor(request: HttpRequest) -> int:
    """The floor the client sent, bounded by the primary's position (``bounded_floor``), or 0. A
    malformed header is ignored."""
    raw = request.headers.get(lsn.LSN_HEADER, "")
    if not raw:
        return lsn.NO_LSN
    try:
        return bounded_floor(lsn.parse_lsn(raw))
    except ValueError:
        logger.info("ignoring malformed %s header %r", lsn.LSN_HEADER, raw[:40])
        return lsn.NO_LSN


def bounded_floor(floor: int) -> int:
    """``floor``, or the primary's position when it is above it. The last probed position
    answers most floors without a query; a floor above it costs one read of the position (and
    with the primary unreachable, the probed one bounds it)."""
    known = replica_health().snapshot().primary_lsn
    if floor <= known:
        return floor
    try:
        current = lsn.primary_position()
    except DatabaseError:
        current = known
    if floor > current:
        logger.info("%s %s is above the primary's position %s: lowered to it", lsn.LSN_HEADER,
                    lsn.format_lsn(floor), lsn.format_lsn(current))
    return min(floor, current)


class ReadYourWritesMiddleware:
    """Place it right after SecurityMiddleware so every database read of the request is inside."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response
        self.expose_read_db = conf.EXPOSE_READ_DB

    def __call__(self, request: HttpRequest) -> HttpResponse:
        with lsn.floor_scope(client_floor(request)):
            response = self.get_response(request)
            if getattr(request, _RETRY_ATTR, False):
                with lsn.primary_only():
                    response = self.get_response(request)
            # Outside a transaction the request's writes have committed: read their floor now.
            in_transaction = connections[lsn.PRIMARY_ALIAS].in_atomic_block
            floor = lsn.current().lsn if in_transaction else lsn.required_lsn()
            if floor:
                response[lsn.LSN_HEADER] = lsn.format_lsn(floor)
            if self.expose_read_db:
                response[lsn.READ_DB_HEADER] = ",".join(lsn.served_by()) or "none"
        return response

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        """A replica failed under a safe request: mark it down and ask ``__call__`` to retry."""
        if not isinstance(exception, REPLICA_ERRORS) or request.method not in SAFE_METHODS:
            return None
        if getattr(request, _RETRY_ATTR, False) or lsn.primary_forced():
            return None  # the retry on the primary failed too: a real error
        failed = replicas_used()
        if not failed:
            return None
        for alias in failed:
            abandon_replica(alias, exception)
        setattr(request, _RETRY_ATTR, True)
        return HttpResponse(status=503)  # placeholder, replaced by the retry in __call__

