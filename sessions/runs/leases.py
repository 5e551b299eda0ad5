"""Leases: a running session's lease is renewed while a live run holds it; a lapsed lease means its run is gone.

Renewals are fenced (``fencing``): only a run that still owns its session extends its lease, and
a renewal tells each run whose fence went stale that it must stop. Lease times are the
database's. ``LeaseKeeper`` renews one run's lease from a timer thread while its task thread is
busy before the batching loop renews it (the models load after the claim).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Mapping
from datetime import timedelta
from typing import Self

from django.db import close_old_connections, connections, transaction
from django.db.models import DurationField, Value
from django.db.models.functions import Now

from metadata.models import Session, SessionStatus
from sessions.conf import conf
from sessions.runs.fencing import lock_owned

logger = logging.getLogger(__name__)


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
