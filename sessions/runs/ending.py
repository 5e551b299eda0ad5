"""A session's end, written once: the one writer of a terminal status, and cancel.

Every end goes through `end_session`: a run's (the worker's outcome, a failure before or after
the batch), the reconciler's (a session no live run will finish), a cancel of a session still
queued, a prediction-cache hit's session, and a session whose task the broker refused. Each
writes the final fields under the row's lock, keeps the cached state true after the commit, and
publishes the stream's ``done`` (which seals it) after the commit.

Cancelling a running session sets its status to ``cancelled`` and leaves its end to its run: the
device's batching loop polls for that and stops it at its next step, and its run writes the end
(a cancel wins over whatever the run was about to write). A session still queued has no run: it
ends here, and the worker that later receives its task finds it ended and does nothing.
"""
from __future__ import annotations

from django.db import transaction
from django.db.models import Q, QuerySet
from django.db.models.functions import Now
from django.utils import timezone

from metadata.history import pg_text
from metadata.models import Session, SessionStatus
from sessions.runs.adoption import end_of_abandoned
from sessions.runs.fencing import lock_owned
from sessions.state import invalidate_session
from sessions.streams import token_stream

ENDED = (SessionStatus.SUCCEEDED, SessionStatus.FAILED)


def end_session(session: Session, status: str, *, error: str = "", finish_reason: str = "",
                text: str | None = None, token_count: int | None = None, stats: dict | None = None,
                next_step: int | None = None, unowned: Q | None = None, adopt_streamed: bool = True) -> str | None:
    """Write the session's end once and tell its stream; return the status written (None: nothing written).

    Fenced by default: only the run whose fence is ``session.attempts`` writes it, while it still
    owns the session (``fencing``); a stale run's end writes nothing. With ``unowned`` (a session
    no run owns: the reconciler's, a queued session's), the end is written only if that condition
    holds under the row's lock instead, and, with ``adopt_streamed``, the steps its last run
    streamed past the committed tokens are adopted first (``adoption.end_of_abandoned``).

    A session that already ended (succeeded, failed, or cancelled with its end written) is left
    as it is: a generation ends exactly once. A session cancelled while it ran (status cancelled,
    no end yet) gets its final fields, and the cancel wins over ``status``: the client was told
    it is cancelled. With ``token_count``, the output (``text``, ``stats``) is written too. The
    instance's fields follow what was written.
    """
    fields = {"status": status, "error": error, "finish_reason": finish_reason, "finished_at": Now(),
              "updated_at": Now(), "last_activity_at": Now(), "lease_expires_at": None}
    if token_count is not None:
        fields.update(token_count=token_count, text=pg_text(text or ""), stats=stats or {})
    fence: int | None = session.attempts
    with transaction.atomic():
        if unowned is None and not lock_owned([(session.pk, session.attempts)]):
            return None  # a later run took the session over, or it ended or went back to its queue
        current = (Session.objects.select_for_update(no_key=True).filter(unowned or Q(), pk=session.pk)
                   .values_list("status", "finished_at").first())
        if current is None or current[0] in ENDED or (current[0] == SessionStatus.CANCELLED and current[1] is not None):
            return None
        if current[0] == SessionStatus.CANCELLED:
            fields.update(status=SessionStatus.CANCELLED, finish_reason="cancelled", error="")
        if unowned is not None:
            fence = None  # no run's: the stream takes it whatever fence it recorded
            if adopt_streamed:  # no run ends it: what its last run streamed is adopted here
                fence = session.attempts
                streamed = end_of_abandoned(session)
                if streamed is not None:
                    fence, next_step = streamed.fence, streamed.next_step
                    if streamed.adopted:
                        fields.update(token_count=len(streamed.token_ids), text=pg_text(streamed.text))
        Session.objects.filter(pk=session.pk).update(**fields)
        invalidate_session(session.pk)
    for name in ("status", "error", "finish_reason", "token_count", "text", "stats"):
        if name in fields:
            setattr(session, name, fields[name])
    done = {"status": fields["status"], "finish_reason": fields["finish_reason"], "error": fields["error"]}
    if stats and stats.get("cached_tokens"):  # the OpenAI usage's prompt_tokens_details.cached_tokens
        done["cached_tokens"] = stats["cached_tokens"]
    transaction.on_commit(lambda: token_stream.publish(session.pk, "done", done, step=next_step, fence=fence))
    return fields["status"]


@transaction.atomic
def cancel_sessions(sessions: QuerySet[Session]) -> tuple[int, int]:
    """Cancel the queued and running sessions among ``sessions``; return (queued, running) counts.

    A queued one ends here (``end_session``); a running one is marked ``cancelled`` for its run to end.
    """
    # the sessions' rows only: an admin's queryset joins the tenant and the target, which are
    # neither read here nor to be locked
    live = list(sessions.select_related(None).select_for_update()
                .filter(status__in=[SessionStatus.QUEUED, SessionStatus.RUNNING])
                .only("id", "created_at", "status", "attempts"))
    queued = [session for session in live if session.status == SessionStatus.QUEUED]
    running = [session.pk for session in live if session.status == SessionStatus.RUNNING]
    for session in queued:
        end_session(session, SessionStatus.CANCELLED, finish_reason="cancelled",
                    unowned=Q(status=SessionStatus.QUEUED), adopt_streamed=False)
    now = timezone.now()
    Session.objects.filter(pk__in=running).update(status=SessionStatus.CANCELLED, updated_at=now)
    for pk in running:
        invalidate_session(pk)  # after the commit
    return len(queued), len(running)
