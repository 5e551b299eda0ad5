"""A validated generation request becomes a session: answered from the prediction cache, or written and sent.

Both APIs (``inference.api`` and its ``openai`` protocol) and the admin's re-run submit through
here, after validating the request against its model (``inference.api.serializers``). A refusal
is a ``GenerationRefused`` (plain exceptions, no HTTP): each API maps it to its own error shape.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from django.db.models import Q
from django.utils import timezone

from core.latency_budget import measure
from metadata.models import Session, SessionStatus, Tenant
from sessions.runs import end_session
from sessions.state import seed_new_session_state
from sessions.submission import prediction_cache
from sessions.submission.admission import insert_within_quota
from sessions.submission.priority import broker_priority
from sessions.submission.refusals import QueueUnavailable, QuotaExceeded
from sessions.tasks import send_generation

logger = logging.getLogger(__name__)


class ValidatedRequest(Protocol):
    """A valid ``GenerationRequestSerializer``: what a submission reads of it."""

    validated_data: dict[str, Any]

    def params(self) -> dict[str, Any]: ...

    def deterministic(self) -> bool:
        """Whether the request gives the same tokens every time (greedy, or sampling with a seed)."""


@dataclass(frozen=True)
class Generation:
    """A started generation: its session, and whether the prediction cache already answered it."""

    session: Session
    cached: bool


# (session just written, its tenant) -> the queue its task goes to, or None for its model's device queue
Router = Callable[[Session, Tenant], str | None]
_router: Router | None = None


def route_with(router: Router | None) -> None:
    """Where sessions are sent (serving registers conversation affinity: ``inference.apps``)."""
    global _router
    _router = router


def start_generation(request: ValidatedRequest, tenant: Tenant, user) -> Generation:
    """Answer from the prediction cache (a session already succeeded) or submit the request."""
    with measure("cache"):
        cached = prediction_cache.serve_from_cache(request.validated_data, request.params(), tenant, user,
                                                   deterministic=request.deterministic())
    if cached is not None:
        return Generation(cached, cached=True)
    return Generation(submit_generation(request, tenant, user), cached=False)


def submit_generation(request: ValidatedRequest, tenant: Tenant, user) -> Session:
    """Write the session and send its task (after the row's commit: the worker must see it).

    The count of the tenant's live sessions, the check against its limit and the session's INSERT
    are one round trip under the tenant's row lock (``admission``), so concurrent submissions of
    one tenant cannot pass its limit together. Raises ``QuotaExceeded`` (nothing written) past the
    limit, ``QueueUnavailable`` if the broker refuses the task (the session is then ended as
    failed). The task's priority comes from the tenant's load (``broker_priority``).
    """
    data = request.validated_data
    session = Session(
        tenant=tenant, created_by=user, target=data["target"], draft=data["draft"],
        drafter=data["drafter"], queue=data["target"].queue, prompt=data["prompt"],
        prompt_tokens=data["prompt_tokens"], params=request.params(),
        enqueued_at=timezone.now(),  # the reconciler re-enqueues it if no worker takes it
    )
    with measure("db_write"):
        admission = insert_within_quota(session)
    if not admission.created:
        raise QuotaExceeded(tenant, admission.live, admission.limit, own_limit=admission.own_limit)
    seed_new_session_state(session)  # the state readers poll, in Redis at once (no read back)
    try:
        queue = (_router(session, tenant) if _router is not None else None) or session.queue
        with measure("enqueue"):  # the Celery instrumentation's apply_async span carries the trace on
            # the tenant lets the worker's claim share decide without a query
            send_generation(session.pk, queue, tenant=tenant.pk, priority=broker_priority(admission.live))
    except Exception as exc:  # broker down: the session must not sit queued forever
        logger.exception("enqueue of session %s failed", session.pk)
        end_session(session, SessionStatus.FAILED, error=f"enqueue failed: {exc}", unowned=Q(status=SessionStatus.QUEUED),
                    adopt_streamed=False)
        raise QueueUnavailable() from exc
    return session
