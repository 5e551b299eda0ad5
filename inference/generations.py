"""The one path of a generation: prediction-cache lookup, session row, enqueue, and ``follow``.

Both APIs (``inference.api`` and its ``openai`` protocol) and the admin's re-run submit through
here, after validating the request with ``GenerationRequestSerializer``. A refusal is a
``GenerationRefused`` (plain exceptions, no HTTP): each API maps it to its own error shape in its
views. ``follow`` (from ``metadata.api.follow``, since the session stream view of the metadata
API needs it too and metadata imports nothing of inference) yields a session's steps to a web
reader.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from django.db import transaction
from django.utils import timezone

from core.latency_budget import measure
from inference import prediction_cache
from inference.models import ModelRole, ModelVersion, VersionStatus
from inference.registry import DEMO_NAME, pending_build
from inference.tasks import generate
from metadata.api.follow import follow
from metadata.models import Session, SessionStatus
from metadata.sessions.state import invalidate_session

__all__ = [
    "Generation", "GenerationRefused", "ModelBuilding", "ModelNotServed", "QueueUnavailable", "ValidatedRequest",
    "follow", "served_target", "start_generation", "submit_generation",
]

logger = logging.getLogger(__name__)


class GenerationRefused(Exception):
    """The platform cannot take this generation now; ``code`` is stable, ``message`` says why."""

    code = "generation_refused"
    retry_after_s: int | None = None  # when asking again may succeed, if known

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueUnavailable(GenerationRefused):
    """The broker refused the task: the session row is marked failed, the client may retry."""

    code = "queue_unavailable"

    def __init__(self, message: str = "the task queue is unavailable; try again shortly.") -> None:
        super().__init__(message)


class ModelNotServed(GenerationRefused):
    """No active target model of that name (``name`` None: none at all)."""

    code = "model_not_found"

    def __init__(self, name: str | None) -> None:
        super().__init__(f"no active target model named '{name}'." if name
                         else "no active target model is registered.")
        self.name = name


class ModelBuilding(GenerationRefused):
    """The model is still being built (the first ``make run``); ask again after ``retry_after_s``."""

    code = "model_building"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ValidatedRequest(Protocol):
    """A valid ``GenerationRequestSerializer``: what a submission reads of it."""

    validated_data: dict[str, Any]

    def params(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Generation:
    """A started generation: its session, and whether the prediction cache already answered it."""

    session: Session
    cached: bool


def served_target(name: str | None) -> ModelVersion:
    """The active target named ``name`` (else the latest promoted one), with its default draft.

    Raises ``ModelBuilding`` while that model (by default the demo) is still being built, else
    ``ModelNotServed``.
    """
    targets = ModelVersion.objects.filter(role=ModelRole.TARGET, status=VersionStatus.ACTIVE)
    if name:
        targets = targets.filter(name=name)
    target = targets.select_related("default_draft").order_by("-promoted_at").first()
    if target is not None:
        return target
    building = pending_build(name or DEMO_NAME)
    if building is not None:
        raise ModelBuilding(building["message"], building["retry_after_s"])
    raise ModelNotServed(name)


def start_generation(request: ValidatedRequest, tenant, user) -> Generation:
    """Answer from the prediction cache (a session already succeeded) or submit the request."""
    with measure("cache"):
        cached = prediction_cache.serve_from_cache(request.validated_data, request.params(), tenant, user)
    if cached is not None:
        return Generation(cached, cached=True)
    return Generation(submit_generation(request, tenant, user), cached=False)


def submit_generation(request: ValidatedRequest, tenant, user) -> Session:
    """Write the session and enqueue its task after commit (the worker must see the row).

    Raises ``QueueUnavailable`` if the broker refuses the task (the row is then marked failed).
    """
    data = request.validated_data
    with measure("db_write"), transaction.atomic():
        session = Session.objects.create(
            tenant=tenant, created_by=user, target=data["target"], draft=data["draft"],
            drafter=data["drafter"], queue=data["target"].queue, prompt=data["prompt"],
            prompt_tokens=data["prompt_tokens"], params=request.params(),
            enqueued_at=timezone.now(),  # the reconciler re-enqueues it if no worker takes it
        )
    try:
        with measure("enqueue"):  # the Celery instrumentation's apply_async span carries the trace on
            generate.apply_async(args=[str(session.pk)], queue=session.queue)
    except Exception as exc:  # broker down: the session must not sit queued forever
        logger.exception("enqueue of session %s failed", session.pk)
        Session.objects.filter(pk=session.pk).update(status=SessionStatus.FAILED, error=f"enqueue failed: {exc}")
        invalidate_session(session.pk)
        raise QueueUnavailable() from exc
    return session
