"""Turn a validated generation request into a session row and a task on its device queue."""
from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone
from rest_framework.exceptions import APIException

from metadata.models import Session, SessionStatus
from metadata.sessions.state import invalidate_session
from core.latency_budget import measure

logger = logging.getLogger(__name__)


class QueueUnavailable(APIException):
    status_code = 503
    default_detail = "the task queue is unavailable; try again shortly."
    default_code = "queue_unavailable"


def submit_generation(serializer, tenant, user) -> Session:
    """Write the session and enqueue its task after commit (the worker must see the row)."""
    from inference.tasks import generate

    data = serializer.validated_data
    with measure("db_write"), transaction.atomic():
        session = Session.objects.create(
            tenant=tenant, created_by=user, target=data["target"], draft=data["draft"],
            drafter=data["drafter"], queue=data["target"].queue, prompt=data["prompt"],
            prompt_tokens=data["prompt_tokens"], params=serializer.params(),
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
