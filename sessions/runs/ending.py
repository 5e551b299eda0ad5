"""Operator actions on sessions that need only the metadata store: cancel.

Cancelling sets the row's status to ``cancelled``; the device's batching loop polls for that and
stops a running session at its next step (and writes its end). A session still queued has no
worker yet: it ends here (finished now, finish reason ``cancelled``, its stream told), and the
worker that later receives its task finds it finished and does nothing.
"""
from __future__ import annotations

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from metadata.models import Session, SessionStatus
from metadata.sessions import token_stream
from metadata.sessions.state import invalidate_session


@transaction.atomic
def cancel_sessions(sessions: QuerySet[Session]) -> tuple[int, int]:
    """Cancel the queued and running sessions among ``sessions``; return (queued, running) counts."""
    now = timezone.now()
    live = list(sessions.select_for_update().filter(status__in=[SessionStatus.QUEUED, SessionStatus.RUNNING])
                .values_list("pk", "status"))
    queued = [pk for pk, status in live if status == SessionStatus.QUEUED]
    running = [pk for pk, status in live if status == SessionStatus.RUNNING]
    Session.objects.filter(pk__in=queued).update(status=SessionStatus.CANCELLED, finish_reason="cancelled",
                                                 finished_at=now, updated_at=now, last_activity_at=now)
    Session.objects.filter(pk__in=running).update(status=SessionStatus.CANCELLED, updated_at=now)
    for pk, _ in live:
        invalidate_session(pk)  # after the commit
    done = {"status": SessionStatus.CANCELLED, "finish_reason": "cancelled", "error": ""}
    transaction.on_commit(lambda: [token_stream.publish(pk, "done", done) for pk in queued])
    return len(queued), len(running)
