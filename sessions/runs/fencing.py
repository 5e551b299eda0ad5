"""Fences: which run of a session may still write it.

A session's lease alone did not say which run holds it: a worker paused past its lease (a GC
pause, a frozen VM, a model load) woke up after the reconciler had re-queued its sessions and
another run had claimed them, and both runs wrote rows, progress, ends and stream events. So each
claim increments ``attempts`` and reads it back in the same statement (``UPDATE … RETURNING``,
``claims``): that number is the run's fence. Every write of the run carries it and is checked by
the database against the row, in the write's own transaction:

- token and candidate rows and progress (the worker's flush), lease renewals (``leases``) and
  the end (``ending``) first lock the session rows they touch (`lock_owned`, ``FOR NO KEY
  UPDATE``) and write only for the runs that still own them: ``attempts`` equal to the fence,
  and the session running (or cancelled with its end not yet written). A claim's UPDATE waits
  for that lock, so a write either commits before the claim (and the new run resumes after it)
  or sees the new fence and is refused.
- the Redis stream refuses a publish whose fence is below the one the newest run recorded
  (``sessions.streams.token_stream.begin_run`` / ``publish_fenced``); the newest run adopts what
  the older ones streamed past the committed tokens (``adoption``).

A run told that its fence is stale stops: the batching loop drops its row without a final write.
Lease times come from the database's clock (``statement_timestamp()``, Django's ``Now()``), never
a worker's.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from datetime import datetime

from django.db import connection

from metadata.models import Session, SessionStatus
from sessions.conf import conf

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
