"""What the runs of a session may do, from the claim to the end, each write fenced and its cached state kept.

- ``claims``: `claim_session` takes the lease and the run's fence in one statement; `hand_over`
  gives the run to what executes it and then publishes the session's state.
- ``fencing``: which run may still write (`owns`, `ran_last`), the row locks a fenced write takes
  (`lock_sessions`, `lock_owned`, `bound_stall`), the database's clock; ``SUPERSEDED``.
- ``leases``: `renew_leases` (fenced heartbeats), ``LeaseKeeper`` (a timer while a run prepares).
- ``adoption``: a run that takes a session over adopts what earlier runs streamed past the
  committed tokens (`committed_tokens`, `start_stream`); an abandoned end does too.
- ``progress``: `write_progress`, many running sessions' token counts and texts in one UPDATE.
- ``ending``: the one `end_session`, and `cancel_sessions`.
- ``requeue``: `requeue` and `fail_abandoned`, for sessions no live run holds; ``reconciler``
  finds them (`reconcile_sessions`, a beat job).
- ``database_retry``: a run's statements tried again while PostgreSQL is briefly out of reach.
"""
from __future__ import annotations

from sessions.runs import database_retry
from sessions.runs.adoption import committed_tokens, start_stream
from sessions.runs.claims import claim_session, hand_over
from sessions.runs.ending import cancel_sessions, end_session
from sessions.runs.fencing import (
    SUPERSEDED,
    bound_stall,
    database_now,
    lock_owned,
    lock_sessions,
    owns,
    ran_last,
)
from sessions.runs.leases import LeaseKeeper, renew_leases
from sessions.runs.progress import PROGRESS_FIELDS, write_progress
from sessions.runs.reconciler import ReconcileReport, reconcile_sessions
from sessions.runs.requeue import EnqueueFailed, fail_abandoned, requeue

__all__ = [
    "PROGRESS_FIELDS", "SUPERSEDED", "EnqueueFailed", "LeaseKeeper", "ReconcileReport", "bound_stall",
    "cancel_sessions", "claim_session", "committed_tokens", "database_now", "database_retry", "end_session",
    "fail_abandoned", "hand_over", "lock_owned", "lock_sessions", "owns", "ran_last", "reconcile_sessions",
    "renew_leases", "requeue", "start_stream", "write_progress",
]
