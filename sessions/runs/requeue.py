"""A session no live run holds goes back to its device queue (the reconciler's), or ends as failed."""
from __future__ import annotations

from datetime import datetime

from django.db.models import Q

from metadata.models import Session, SessionStatus
from sessions.runs.ending import end_session
from sessions.state import invalidate_session
from sessions.streams import token_stream
from sessions.tasks import send_generation


class EnqueueFailed(Exception):
    """The broker refused a re-enqueued session's task: it stays queued (see `requeue`)."""


def requeue(pk, queue: str, condition: Q, now: datetime, *, next_fence: int | None = None, **fields) -> bool:
    """Mark the session enqueued now (if ``condition`` still holds), then send it a task.

    ``next_fence`` (a lost run's session: its attempts + 1) is recorded on its stream first, so
    the lost run, should it wake up, streams nothing before the next claim. False when a worker
    claimed or ended it meanwhile; `EnqueueFailed` when the broker refuses the task (the session
    stays queued, so a later pass sends it again).
    """
    if not Session.objects.filter(condition, pk=pk).update(enqueued_at=now, updated_at=now, **fields):
        return False
    invalidate_session(pk)
    if next_fence is not None:
        token_stream.raise_fence(pk, next_fence)
    try:
        send_generation(pk, queue)
    except Exception as error:
        raise EnqueueFailed(f"enqueue of session {pk} failed") from error
    return True


def fail_abandoned(pk, condition: Q, error: str, worker: str) -> bool:
    """End the session as failed if ``condition`` still holds; True when this call ended it.

    The condition is checked under the row's lock in the transaction that writes the end, so no
    worker can claim it in between; a session cancelled while it ran ends as cancelled. Its
    stream is ended with the session's next fence, sealing it against any older run's late
    publish (``end_session``).
    """
    session = Session.objects.filter(pk=pk).select_related("target").first()
    if session is None:
        return False
    Session.objects.filter(condition, pk=pk).update(worker=worker)
    return end_session(session, SessionStatus.FAILED, error=error, unowned=condition) is not None
