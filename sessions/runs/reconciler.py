"""Find the sessions no worker will finish, and put them back on their queue or end them.

A session is left behind in two ways (DESIGN.md, the Celery traps):

- Its worker died. The session is ``running`` but its lease lapsed: the batching loop renews
  the lease of every session it holds every ``SESSION_LEASE_S / 3``, so a lapsed lease means no
  live loop holds it. The task's message sits in the broker's unacknowledged set until the
  visibility timeout, so the reconciler re-enqueues the session on its queue; the claim lets
  one worker take it, and that worker resumes from the committed tokens. A session already
  claimed ``MAX_ATTEMPTS`` times fails instead, with the reason.
- It was cancelled while it ran, and its worker died before writing the end. Cancelling a
  running session sets its status and leaves the end (``finished_at``, the stream's ``done``) to
  the batching loop, which stops it at its next step; a loop that is gone never does, and the
  session's lease (renewed only while it runs) lapses. The reconciler writes that end: the
  session is ``cancelled`` with its end, and its stream followers are told.
- Its task was lost (the broker's database flushed, a failover without persistence). The
  session stays ``queued`` with no message, which nothing can observe from here, so a session
  queued ``RECONCILE_QUEUED_S`` after its last enqueue gets another message. A duplicate is
  harmless: the claim lets one delivery run, the others return at once. A session still queued
  ``RECONCILE_GIVE_UP_S`` after its creation fails: no worker serves its queue.

One pass at a time (``pg_try_advisory_lock`` on a direct connection). This module only finds
the sessions; ``requeue`` changes them (`requeue`, `fail_abandoned`, which writes a cancelled
session's end as cancelled), each change an UPDATE that repeats the condition the session was
picked by, so a worker that claims or ends the session in between wins. Nothing is published to
a session's stream here but a failure's or a cancellation's final event (by ``end_session``): a
re-enqueued session's stream continues when it resumes.
"""
from __future__ import annotations

import logging
import socket
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q

from core.database_config import maintenance_alias
from metadata.models import Session, SessionStatus
from metadata.partitions import advisory_lock
from metadata.replicas import lsn
from sessions.conf import conf
from sessions.runs.fencing import database_now
from sessions.runs.requeue import EnqueueFailed, fail_abandoned, requeue

logger = logging.getLogger(__name__)

RECONCILER_LOCK = 0x5350_4543_0020  # "SPEC" + 0x20; partitions 1 and 2, statement snapshots 0x10
BATCH = 500  # sessions one pass handles per kind; the next pass (15 s later) takes the rest


@dataclass
class ReconcileReport:
    """What one pass did, by session id."""

    resumed: list[str] = field(default_factory=list)  # a lost worker's session, back on its queue
    requeued: list[str] = field(default_factory=list)  # a queued session given another task
    failed: list[str] = field(default_factory=list)  # attempts exhausted, or waited too long
    cancelled: list[str] = field(default_factory=list)  # cancelled while running; its worker died
    enqueue_errors: list[str] = field(default_factory=list)  # left queued; the next pass retries

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (f"resumed={len(self.resumed)} requeued={len(self.requeued)} failed={len(self.failed)} "
                f"cancelled={len(self.cancelled)} enqueue_errors={len(self.enqueue_errors)}")


def lease_lapsed(now: datetime) -> Q:
    """No worker renewed the session's lease (a null lease: no activity for a lease's length)."""
    lease = timedelta(seconds=conf.SESSION_LEASE_S)
    return Q(lease_expires_at__lt=now) | Q(lease_expires_at__isnull=True, last_activity_at__lt=now - lease)


def lapsed_lease(now: datetime) -> Q:
    """Running, and no worker renewed its lease."""
    return Q(status=SessionStatus.RUNNING) & lease_lapsed(now)


def cancelled_unended(now: datetime) -> Q:
    """Cancelled while it ran, its end not written, and no worker has touched it for a lease's length."""
    return Q(status=SessionStatus.CANCELLED, finished_at__isnull=True) & lease_lapsed(now)


def stale_enqueue(now: datetime) -> Q:
    """Queued, and its last task was handed to the broker longer than RECONCILE_QUEUED_S ago."""
    cutoff = now - timedelta(seconds=conf.RECONCILE_QUEUED_S)
    return Q(status=SessionStatus.QUEUED) & (
        Q(enqueued_at__lt=cutoff) | Q(enqueued_at__isnull=True, created_at__lt=cutoff))


def waited_too_long(now: datetime) -> Q:
    """Queued, and created longer than RECONCILE_GIVE_UP_S ago."""
    return Q(status=SessionStatus.QUEUED, created_at__lt=now - timedelta(seconds=conf.RECONCILE_GIVE_UP_S))


class SessionReconciler:
    """One reconciliation pass over the live sessions (``run``)."""

    def __init__(self) -> None:
        self.worker_name = f"reconciler@{socket.gethostname()}"

    def run(self, now: datetime | None = None) -> ReconcileReport:
        """Reconcile once; ``MaintenanceLockBusy`` at once if another pass is running.

        Leases are compared with the database's clock (``now()``), the one they were written by:
        a reconciler on a host whose clock runs ahead must not take live sessions away.
        """
        now = now or database_now()
        report = ReconcileReport()
        with lsn.primary_only(), advisory_lock(RECONCILER_LOCK, maintenance_alias(settings.DATABASES)):
            self.lost_workers(now, report)
            self.abandoned_cancels(now, report)
            self.given_up(now, report)
            self.lost_tasks(now, report)
        if report.resumed or report.failed or report.cancelled or report.enqueue_errors:
            logger.warning("reconcile_sessions: %s", report.summary())
        elif report.requeued:  # a backlog looks the same: not worth a warning each pass
            logger.info("reconcile_sessions: %s", report.summary())
        return report

    def lost_workers(self, now: datetime, report: ReconcileReport) -> None:
        rows = (Session.objects.filter(lapsed_lease(now)).order_by("last_activity_at")
                .values("pk", "attempts", "queue", "worker")[:BATCH])
        for row in rows:
            pk, attempts, worker = row["pk"], row["attempts"], row["worker"] or "an unknown worker"
            condition = lapsed_lease(now) & Q(attempts=attempts)
            if attempts >= conf.MAX_ATTEMPTS:
                error = (f"worker lost {attempts} times (last on {worker}); gave up after "
                         f"{conf.MAX_ATTEMPTS} attempts (SPECOPS_MAX_ATTEMPTS)")
                self._fail(pk, condition, error, now, report)
                continue
            note = (f"worker lost (attempt {attempts} of {conf.MAX_ATTEMPTS}, on {worker}); re-enqueued "
                    f"to resume from its committed tokens")
            if self._requeue(pk, row["queue"], condition, now, report, next_fence=attempts + 1,
                             status=SessionStatus.QUEUED, lease_expires_at=None, error=note):
                report.resumed.append(str(pk))

    def abandoned_cancels(self, now: datetime, report: ReconcileReport) -> None:
        """Write the end of each session cancelled while it ran whose worker is gone."""
        rows = (Session.objects.filter(cancelled_unended(now)).order_by("last_activity_at")
                .values_list("pk", flat=True)[:BATCH])
        for pk in rows:
            # the end written under the row's lock, the condition checked again there; a cancelled
            # session's end is written as cancelled (end_session), its stream told
            if fail_abandoned(pk, cancelled_unended(now), "cancelled; its worker was lost", self.worker_name):
                report.cancelled.append(str(pk))

    def given_up(self, now: datetime, report: ReconcileReport) -> None:
        rows = Session.objects.filter(waited_too_long(now)).order_by("created_at").values_list("pk", "queue")[:BATCH]
        for pk, queue in rows:
            error = (f"no worker took it within {conf.RECONCILE_GIVE_UP_S:g} s of its creation "
                     f"(queue {queue!r}; SPECOPS_RECONCILE_GIVE_UP_S)")
            self._fail(pk, waited_too_long(now), error, now, report)

    def lost_tasks(self, now: datetime, report: ReconcileReport) -> None:
        rows = (Session.objects.filter(stale_enqueue(now)).exclude(waited_too_long(now))
                .order_by("created_at").values_list("pk", "queue")[:BATCH])
        for pk, queue in rows:
            if self._requeue(pk, queue, stale_enqueue(now), now, report):
                report.requeued.append(str(pk))

    def _requeue(self, pk, queue: str, condition: Q, now: datetime, report: ReconcileReport, **fields) -> bool:
        """Re-enqueue the session if ``condition`` still holds (``requeue``)."""
        try:
            return requeue(pk, queue, condition, now, **fields)
        except EnqueueFailed:  # the broker is down: it stays queued, and a later pass sends it again
            logger.exception("reconcile_sessions: enqueue of session %s failed", pk)
            report.enqueue_errors.append(str(pk))
            return False

    def _fail(self, pk, condition: Q, error: str, now: datetime, report: ReconcileReport) -> None:
        """Fail the session if ``condition`` still holds (``fail_abandoned``)."""
        if fail_abandoned(pk, condition, error, self.worker_name):
            report.failed.append(str(pk))


def reconcile_sessions(now: datetime | None = None) -> ReconcileReport:
    """One pass (see the module docstring); raises ``MaintenanceLockBusy`` when one is running."""
    return SessionReconciler().run(now)
