"""Fences: which run of a session may still write it.

A session's lease alone did not say which run holds it: a worker paused past its lease (a GC
pause, a frozen VM, a model load) woke up after the reconciler had re-queued its sessions and
another run had claimed them, and both runs wrote rows, progress, finishes and stream events
(issue 27). Now each claim increments ``attempts`` and reads it back in the same statement
(``UPDATE … RETURNING``): that number is the run's fence. Every write of the run carries it and
is checked by the database against the row, in the write's own transaction:

- token and candidate rows and progress (recorder.BatchRecorder.write), lease renewals
  (lifecycle.renew_leases) and the end (lifecycle.finish_session) first lock the session rows
  they touch (`lock_owned`, ``FOR NO KEY UPDATE``) and write only for the runs that still own
  them: ``attempts`` equal to the fence, and the session running (or cancelled with its end not
  yet written). A claim's UPDATE waits for that lock, so a write either commits before the claim
  (and the new run resumes after it) or sees the new fence and is refused.
- the Redis stream refuses a publish whose fence is below the one the newest run recorded
  (metadata.sessions.token_stream.begin_run / publish_fenced); the newest run adopts what the
  older ones streamed past the committed tokens (adoption.py).

A run told that its fence is stale stops: the batching loop drops its row without a final write.
Lease times come from the database's clock (``statement_timestamp()``, Django's ``Now()``), never
a worker's.
"""
from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Hashable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Self

from django.db import close_old_connections, connection, connections, transaction
from django.db.models import DurationField, Value
from django.db.models.functions import Now

from inference.conf import conf
from metadata.ids import created_at_of
from metadata.models import Session, SessionStatus

logger = logging.getLogger(__name__)

SUPERSEDED = "superseded"  # a run's status when a later run of its session took it over


def owns(status: str, finished_at: datetime | None, attempts: int, fence: int) -> bool:
    """Whether the run of ``fence`` may still write a session in this state (progress, lease, end)."""
    if attempts != fence:
        return False
    return status == SessionStatus.RUNNING or (status == SessionStatus.CANCELLED and finished_at is None)


def ran_last(status: str, finished_at: datetime | None, attempts: int, fence: int) -> bool:
    """Whether the run of ``fence`` may still add token and candidate rows: it owns the session,
    or the session ended with no later claim (the rows of a flush that failed just before the
    run's own end go again after it: they are that run's history, and no other run made any).
    Never under a session handed back to its queue: the next run resumes from what is committed."""
    return owns(status, finished_at, attempts, fence) or (
        attempts == fence and status != SessionStatus.QUEUED and finished_at is not None)


def bound_stall() -> None:
    """End this transaction on the server if its run goes quiet inside it for a lease (call first
    inside a fenced write's ``transaction.atomic``).

    The locks a write takes would otherwise outlive a worker paused or cut off between its lock
    and its commit (SIGSTOP, a frozen VM, a host off the network: the server waits on an idle
    connection for hours): no other run could claim the session, and the reconciler's pass would
    wait on the row too. ``SET LOCAL`` (``set_config(..., true)``): the transaction's alone, as
    PgBouncer's transaction pooling needs. A run ended this way finds its connection gone; its
    next write is checked against the fence as any other."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('idle_in_transaction_session_timeout', %s, true)",
                       [str(max(1, round(conf.SESSION_LEASE_S * 1000)))])


def lock_sessions(runs: Iterable[tuple[Hashable, int]]) -> dict[Hashable, tuple]:
    """Lock the sessions of ``runs`` ((session id, fence) pairs) until the transaction ends (call
    inside ``transaction.atomic``); their (status, finished_at, attempts) by id. A claim's UPDATE
    waits for the lock, so what the caller writes commits before any later claim or not at all
    (and no longer than a lease after the caller went quiet: `bound_stall`)."""
    ids = sorted({pk for pk, _ in runs}, key=str)
    if not ids:
        return {}
    bound_stall()
    return {pk: (status, finished_at, attempts) for pk, status, finished_at, attempts in
            Session.objects.select_for_update(no_key=True).filter(pk__in=ids).order_by("pk")
            .values_list("pk", "status", "finished_at", "attempts")}


def lock_owned(runs: Iterable[tuple[Hashable, int]]) -> set[tuple[Hashable, int]]:
    """Lock the sessions of ``runs`` and return the pairs whose run still owns its session."""
    runs = set(runs)
    current = lock_sessions(runs)
    return {(pk, fence) for pk, fence in runs if pk in current and owns(*current[pk], fence)}


def database_now() -> datetime:
    """The database's clock: the one every lease is measured by, whatever host asks."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        return cursor.fetchone()[0]


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
RETURNING {{returning}}"""
_CLAIM_SQL = _CLAIM.format(created_at="%s", returning="attempts")


def claim(session: Session) -> int | None:
    """Take the session's lease (only when it is queued, or running with a lapsed lease, by the
    database's clock) and return the run's fence, or None when another run holds it.

    The fence is read back in the claiming statement, so no other claim can come between; it is
    also set on ``session.attempts``, which the run's writes carry from here on. The session's
    cached state is left to the caller (``invalidate_session``): run_session invalidates it once
    the run is in the batch, off the path to its first token.
    """
    with connections["default"].cursor() as cursor:
        cursor.execute(_CLAIM_SQL, [conf.SESSION_LEASE_S, socket.gethostname(), session.pk, session.created_at])
        row = cursor.fetchone()
    if row is None:
        return None
    session.attempts = row[0]
    return row[0]


def _columns(model, alias: str) -> str:
    return ", ".join(f'{alias}."{field.column}"' for field in model._meta.concrete_fields)


def claim_session(session_id) -> Session | None:
    """``claim`` for a session known by its id alone (a task's message), and its row read back:
    the claimed Session with its ``target`` and ``draft`` loaded, or None when it was not
    claimable (ended, or another run holds its lease: the caller reads its status).

    One round trip, pruned to the session's partition (a UUIDv7 id carries its ``created_at``;
    an older id's comes from a scalar subquery): it was a read by id alone, which searched every
    partition's index, then the claim.
    """
    from metadata.models import ModelVersion

    created_at = created_at_of(session_id)
    sessions = Session._meta.db_table
    when = "%s" if created_at is not None else f"(SELECT created_at FROM {sessions} WHERE id = %s)"
    sql = f"""
WITH claimed AS ({_CLAIM.format(created_at=when, returning="*")})
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


def lease_until() -> Now:
    """``statement_timestamp() + SESSION_LEASE_S``, on the database's clock."""
    return Now() + Value(timedelta(seconds=conf.SESSION_LEASE_S), output_field=DurationField())


def renew_leases(runs: Mapping[Hashable, int]) -> set:
    """Heartbeat: extend the leases of the sessions whose runs (id -> fence) still own them, so
    the reconciler leaves them be; return the ids whose fence is stale (another run took over, or
    the session was re-queued or ended under this run): their run must stop."""
    wanted = set(runs.items())
    if not wanted:
        return set()
    with transaction.atomic():
        owned = lock_owned(wanted)
        if owned:
            Session.objects.filter(pk__in=[pk for pk, _ in owned], status=SessionStatus.RUNNING).update(
                lease_expires_at=lease_until(), last_activity_at=Now())
    return {pk for pk, _ in wanted - owned}


class LeaseKeeper:
    """Renews one run's lease from a timer thread while its task thread is busy (the models
    load under the residency's lock after the claim, which may take longer than a lease)."""

    def __init__(self, session: Session) -> None:
        self.runs = {session.pk: session.attempts}
        self.stale = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"specops-lease-{session.pk}", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.wait(conf.SESSION_LEASE_S / 3):
                try:
                    self.stale = self.stale or bool(renew_leases(self.runs))
                except Exception:  # the next tick tries again; the loop's renewals follow
                    logger.exception("renewing the lease of %s while it prepares failed", list(self.runs))
                    close_old_connections()
        finally:
            connections.close_all()  # this thread's
