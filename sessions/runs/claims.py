"""The claim: a run takes a session's lease and its fence in one statement, then hands the run over.

A claim succeeds only when the session is queued, or running with its lease lapsed by the
database's clock, so two deliveries of one session never run it twice at once; it returns the
run's fence (the incremented ``attempts``, ``fencing``). The session's cached state is published
once the run is handed over (`hand_over`), off the path to its first token.
"""
from __future__ import annotations

import socket
import time
from collections.abc import Callable

from django.db import connections

from metadata.ids import created_at_of
from metadata.models import ModelVersion, Session
from sessions.conf import conf
from sessions.runs.leases import renew_leases
from sessions.state import invalidate_session


# {created_at}: a parameter, or for an id that carries no time a subquery of it
_CLAIM = f"""
UPDATE {Session._meta.db_table}
   SET status = 'running', started_at = COALESCE(started_at, statement_timestamp()),
       updated_at = statement_timestamp(), last_activity_at = statement_timestamp(),
       lease_expires_at = statement_timestamp() + make_interval(secs => %s),
       worker = %s, attempts = attempts + 1
 WHERE id = %s AND created_at = {{created_at}}
   AND (status = 'queued' OR (status = 'running' AND (lease_expires_at IS NULL
                                                      OR lease_expires_at < statement_timestamp())))
RETURNING *"""


def _columns(model, alias: str) -> str:
    return ", ".join(f'{alias}."{field.column}"' for field in model._meta.concrete_fields)


def claim_session(session_id) -> Session | None:
    """Take the session's lease (only when it is queued, or running with a lapsed lease, by the
    database's clock) and read its row back: the claimed Session with its ``target`` and
    ``draft`` loaded, its ``attempts`` the run's fence, or None when it was not claimable (ended,
    or another run holds its lease: the caller reads its status).

    The fence is read back in the claiming statement, so no other claim can come between; the
    run's writes carry it from here on. The session's cached state is published by `hand_over`,
    once the run is handed over.

    One round trip, pruned to the session's partition (a UUIDv7 id carries its ``created_at``;
    an older id's comes from a scalar subquery), where a read by id alone would search every
    partition's index before the claim.
    """
    created_at = created_at_of(session_id)
    sessions = Session._meta.db_table
    when = "%s" if created_at is not None else f"(SELECT created_at FROM {sessions} WHERE id = %s)"
    sql = f"""
WITH claimed AS ({_CLAIM.format(created_at=when)})
SELECT {_columns(Session, "claimed")}, {_columns(ModelVersion, "target")}, {_columns(ModelVersion, "draft")}
  FROM claimed
  JOIN {ModelVersion._meta.db_table} target ON target.id = claimed.target_id
  LEFT JOIN {ModelVersion._meta.db_table} draft ON draft.id = claimed.draft_id"""
    db = connections["default"]
    with db.cursor() as cursor:
        cursor.execute(sql, [conf.SESSION_LEASE_S, socket.gethostname(), session_id,
                             created_at if created_at is not None else session_id])
        row = cursor.fetchone()
    if row is None:
        return None
    first = len(Session._meta.concrete_fields)
    second = first + len(ModelVersion._meta.concrete_fields)
    session = _instance(Session, row[:first], db)
    session.target = _instance(ModelVersion, row[first:second], db)
    session.draft = _instance(ModelVersion, row[second:], db) if row[second] is not None else None
    return session


def _instance(model, values, db):
    """A model instance from its concrete fields' column values, converted as the ORM converts a
    row it reads (a JSON field's text parsed, ...)."""
    fields = model._meta.concrete_fields
    converted = []
    for field, value in zip(fields, values, strict=True):
        column = field.get_col(model._meta.db_table)
        for convert in db.ops.get_db_converters(column) + column.get_db_converters(db):
            value = convert(value, column, db)
        converted.append(value)
    return model.from_db(db.alias, [field.attname for field in fields], converted)


def hand_over(session: Session, submit: Callable[[], None], *, claimed_at: float) -> bool:
    """Hand the claimed run to what executes it (``submit``), then publish the session's state
    (running); False, with nothing handed over, when the run lost the session while it prepared.

    Another run can have claimed the session only if this run's lease lapsed while it prepared
    (a slow model load, ``claimed_at`` by ``time.monotonic()`` before the claim): checked (and
    renewed) then; a quick prepare saves the round trip. The state's invalidation (a floor read,
    the write-through's reload and four Redis round trips: 15-40 ms on a loaded worker, measured)
    runs once the run is handed over, not before it: until it lands a reader may see 'queued'
    for a running session, which none acts on (a cancel and every other decision lock or
    condition on the row itself).
    """
    prepared_within_lease = time.monotonic() - claimed_at < conf.SESSION_LEASE_S / 2
    if not prepared_within_lease and renew_leases({session.pk: session.attempts}):
        invalidate_session(session.pk)  # the claim changed the row
        return False
    submit()
    invalidate_session(session.pk)
    return True
