"""A session's life in a worker, in one place: claim, prepare, run, finish.

- Claim: the task takes the session's lease (`claim_session`), an UPDATE that succeeds only when the
  session is queued, or running with an expired lease, so two deliveries of one session never
  run it twice at once; it returns the run's fence (the incremented ``attempts``), which every
  write of the run carries (fencing.py). The lease is renewed while the models load, then by the
  batching loop (`renew_leases`); a renewal refused for a stale fence tells the loop to drop
  the run. Lease times are the database's (``now()``).
- Prepare: everything that can be checked before the loop is checked here (the models load, the
  prompt tokenizes). A redelivered or re-enqueued session resumes: its committed tokens, and the
  steps an earlier run streamed after them (adopted: a client may have seen them), are prefilled
  with the prompt and never generated again, and its stream continues after them.
- Run: `run_session` hands the `SessionJob` to the device's batching loop and waits on
  ``job.done``.
- Finish: every end is written by `finish_session`, once. A session that leaves the batch is
  ended in two halves: the loop thread computes its outcome (`session_end`), and the writer
  thread writes it after the flush of its rows (`write_end`): `finish_session`, the prediction
  cache for a success, the request's metrics, the trace's end, and last ``job.done``, which wakes
  the task thread (Celery's late ack then means "written"). The claim, the flushes and the end
  are tried again while PostgreSQL is out of reach (database_retry); a write that still fails
  ends the session, as failed. The task ends the sessions that never reach the loop or that the loop
  never answers; the reconciler ends (`fail_abandoned`) or re-enqueues (`requeue`) the sessions
  no worker will finish.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from celery import current_app
from django.db import close_old_connections, connections, transaction
from django.db.models import Q
from django.db.models.functions import Now

from core import latency_budget
from inference.conf import conf
from inference.engine.batch.engine import BatchRequest
from inference import affinity
from inference.prefix_scope import session_cache_scope
from inference.worker import canary, database_retry, metrics, suffix_feed
from inference.worker.adoption import committed_tokens, end_of_abandoned, start_stream
from inference.worker.fencing import (
    SUPERSEDED,
    LeaseKeeper,
    claim_session,
    lock_owned,
    renew_leases,
)
from inference.worker.recorder import SessionRecorder, pg_text
from inference.worker.residency import residency
from inference.worker.session_params import draft_config, generation_config
from inference.worker.session_job import SessionEnd, SessionJob
from metadata.models import Session, SessionStatus
from metadata.sessions import token_stream
from metadata.sessions.state import invalidate_session

if TYPE_CHECKING:
    from inference.engine.batch.engine import RowEvent

logger = logging.getLogger(__name__)

# how long a task thread waits past the session's own deadline before it gives up on the loop
WAIT_MARGIN_S = 60.0
GENERATE_TASK = "inference.generate"  # by name: inference.tasks imports this module


# -- claim --------------------------------------------------------------------------------

# -- prepare ------------------------------------------------------------------------------

def prepare(session: Session) -> SessionJob:
    """Load the session's models and build its batch request (errors here fail the session).

    The run resumes from its committed tokens and the steps earlier runs streamed after them
    (`start_stream`).
    """
    target = residency.get(session.target)
    draft = residency.get(session.draft) if session.draft else None
    tokenizer = target.tokenizer
    prompt_ids = tokenizer(session.prompt)["input_ids"]
    # a first run (attempts 1: the first claim) has no committed tokens: no query
    resumed, next_step = committed_tokens(session) if session.attempts > 1 else ([], 0)
    resumed, next_step = start_stream(session, resumed, next_step, tokenizer.decode)
    request = BatchRequest(
        request_id=session.pk, prompt_ids=prompt_ids,
        config=generation_config(session.params, tokenizer.eos_token_id),
        drafter=session.drafter, draft_config=draft_config(session.drafter, session.params),
        deadline=time.monotonic() + conf.GENERATION_TIMEOUT_S, resume_ids=tuple(resumed),
        corpus=suffix_feed.corpus_key(session),
        # a tenant's rows adopt only the cached prefixes of its own trust boundary (prefix_scope.py)
        cache_scope=session_cache_scope(session))
    recorder = SessionRecorder(session, tokenizer.decode, token_ids=list(resumed), step=next_step)
    return SessionJob(session=session, request=request, target=target, draft=draft,
                      model_name=session.target.name, recorder=recorder,
                      dspark=residency.dspark(session.target))


def finished_before(job: SessionJob) -> str | None:
    """The finish reason when the committed tokens already end the generation (a crash between
    the last commit and the session's final update), else None."""
    tokens, config = list(job.request.resume_ids), job.request.config
    if not tokens:
        return None
    if len(tokens) >= config.max_new_tokens:
        return "length"
    if config.eos_token_id is not None and tokens[-1] in config.eos_token_ids:
        return "eos"
    if config.stop_strings:
        text = job.target.tokenizer.decode(tokens)
        if any(stop in text for stop in config.stop_strings):
            return "stop"
    return None


# -- run ----------------------------------------------------------------------------------

def run_session(session_id, submit: Callable[[SessionJob], None]) -> str:
    """Generate for ``session_id`` in the device's batch (``submit`` hands it to the batching
    loop, batching_loop.DeviceBatchLoop.submit); return its final status."""
    claimed_at = time.monotonic()  # before the claim's UPDATE: the lease runs from later than this
    # The claim reads the row back (with its models) in the same statement. A claim whose commit
    # went through but whose answer was lost finds the lease held: the session then waits for its
    # lease to lapse and the reconciler (a resumed run, as a crash).
    session = database_retry.retrying(lambda: claim_session(session_id), f"claiming session {session_id}")
    if session is None:  # ended (a redelivery of a finished task does nothing), or another run holds it
        return Session.objects.get(pk=session_id).status
    if session.attempts > conf.MAX_ATTEMPTS:  # no run will generate it: ended as the reconciler ends one
        end_session(session, SessionStatus.FAILED,
                    error=f"gave up after {conf.MAX_ATTEMPTS} attempts (the worker was lost each time)",
                    abandoned=Q(status=SessionStatus.RUNNING, attempts=session.attempts))
        return SessionStatus.FAILED
    try:
        with LeaseKeeper(session):
            job = prepare(session)
    except Exception as exc:
        logger.exception("session %s could not start", session.pk)
        finish_session(session, SessionStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
        metrics.observe_generation(session.drafter, SessionStatus.FAILED, 0.0, None)
        raise
    reason = finished_before(job)
    if reason is not None:
        tokens = job.recorder.token_ids
        finish_session(session, SessionStatus.SUCCEEDED, finish_reason=reason, token_ids=tokens,
                       text=job.target.tokenizer.decode(tokens), stats={"resumed_tokens": len(tokens)},
                       next_step=job.recorder.step)
        return SessionStatus.SUCCEEDED
    # Another run can have claimed the session only if this run's lease lapsed while it prepared
    # (a slow model load): checked (and renewed) then; a quick prepare saves the round trip.
    prepared_within_lease = time.monotonic() - claimed_at < conf.SESSION_LEASE_S / 2
    if not prepared_within_lease and renew_leases({session.pk: session.attempts}):
        logger.warning("session %s: run %d was taken over while it prepared", session.pk, session.attempts)
        invalidate_session(session.pk)  # this run's claim changed the row
        return SUPERSEDED
    submit(job)
    # The claim's cache invalidation (a floor read, the write-through's reload and four Redis
    # round trips: 15-40 ms on a loaded worker, measured) runs while the run is in the batch,
    # not before it. Until it lands a reader may see 'queued' for a running session, which none
    # acts on: a cancel and every other decision lock or condition on the row itself.
    invalidate_session(session.pk)
    # The wait holds no database connection: with a pool per process, SPECOPS_MAX_BATCH waiting
    # threads would otherwise starve the batching loop's own writes.
    connections.close_all()
    if not job.done.wait(conf.GENERATION_TIMEOUT_S + WAIT_MARGIN_S):
        logger.error("session %s: the batching loop did not end it in time", session.pk)
        finish_session(session, SessionStatus.FAILED, error="the batching loop did not answer")
        return SessionStatus.FAILED
    suffix_feed.feed_finished(job)  # a success teaches its tenant's suffix index
    return job.status


# -- finish -------------------------------------------------------------------------------

def finish_session(session: Session, status: str, *, error: str = "", finish_reason: str = "",
                   token_ids: list[int] | None = None, text: str | None = None,
                   stats: dict | None = None, next_step: int | None = None) -> bool:
    """Write the session's outcome once and tell its stream; the cache entry goes after the commit.

    Fenced: only the run whose fence is ``session.attempts`` writes it, while it still owns the
    session (fencing.py); a stale run's end writes nothing (returns False). A session that
    already ended (succeeded, failed, or cancelled with its end written) is left as it is
    (returns False, no second final event): a generation ends exactly once. A session cancelled
    while it ran (status cancelled, no end yet) gets its final fields, and the cancel wins over
    whatever this run was about to write: the client was told it is cancelled.
    """
    return end_session(session, status, error=error, finish_reason=finish_reason, token_ids=token_ids,
                       text=text, stats=stats, next_step=next_step) is not None


def end_session(session: Session, status: str, *, error: str = "", finish_reason: str = "",
                token_ids: list[int] | None = None, text: str | None = None, stats: dict | None = None,
                next_step: int | None = None, abandoned: Q | None = None) -> str | None:
    """`finish_session`, returning the status written (None: nothing written).

    With ``abandoned`` (the reconciler's, for a session no run owns), the end is written only if
    that condition holds under the row's lock, instead of the run's fence, and the steps the last
    run streamed past the committed tokens are adopted first (adoption.end_of_abandoned).
    """
    fields = {"status": status, "error": error, "finish_reason": finish_reason, "finished_at": Now(),
              "updated_at": Now(), "last_activity_at": Now(), "lease_expires_at": None}
    if token_ids is not None:
        fields.update(token_count=len(token_ids), text=pg_text(text or ""), stats=stats or {})
    fence = session.attempts
    with transaction.atomic():
        if abandoned is None and not lock_owned([(session.pk, session.attempts)]):
            return None  # a later run took the session over, or it ended or went back to its queue
        current = (Session.objects.select_for_update(no_key=True).filter(abandoned or Q(), pk=session.pk)
                   .values_list("status", "finished_at").first())
        ended = current is None or current[0] in (SessionStatus.SUCCEEDED, SessionStatus.FAILED) or (
            current[0] == SessionStatus.CANCELLED and current[1] is not None)
        if ended:
            return None
        if current[0] == SessionStatus.CANCELLED:
            fields.update(status=SessionStatus.CANCELLED, finish_reason="cancelled", error="")
        if abandoned is not None:  # no run ends it: what its last run streamed is adopted here
            streamed = end_of_abandoned(session)
            if streamed is not None:
                fence, next_step = streamed.fence, streamed.next_step
                if streamed.adopted:
                    fields.update(token_count=len(streamed.token_ids), text=pg_text(streamed.text))
        Session.objects.filter(pk=session.pk).update(**fields)
        invalidate_session(session.pk)
    done = {"status": fields["status"], "finish_reason": fields["finish_reason"], "error": fields["error"]}
    if stats and stats.get("cached_tokens"):  # the OpenAI usage's prompt_tokens_details.cached_tokens
        done["cached_tokens"] = stats["cached_tokens"]
    token_stream.publish(session.pk, "done", done, step=next_step, fence=fence)
    return fields["status"]


def status_of(finish_reason: str) -> str:
    if finish_reason == "cancelled":
        return SessionStatus.CANCELLED
    if finish_reason in ("error", "timeout"):
        return SessionStatus.FAILED
    return SessionStatus.SUCCEEDED


def session_end(job: SessionJob, finish_reason: str, error: str, event: RowEvent | None) -> SessionEnd:
    """Loop thread: what the session's end will write, its text and stats included."""
    recorder = job.recorder.snapshot()
    status = status_of(finish_reason)
    try:
        stats = None
        if event is not None:
            stats = event.stats.to_dict()
            created = job.session.created_at.timestamp()
            gaps = metrics.inter_token_gaps(recorder.step_times, recorder.step_tokens)
            stats.update(
                ttft_seconds=recorder.step_times[0] - created if recorder.step_times else None,
                queue_seconds=recorder.admitted_at - created if recorder.admitted_at else None,
                itl_seconds=sum(gaps) / len(gaps) if gaps else None)
            stats.update(drafter=event.drafter, batch_rows_max=recorder.batch_rows_max,
                         depth_choices={str(k): v for k, v in sorted(event.depth_choices.items())})
            if finish_reason == "timeout":
                error = error or f"generation exceeded {conf.GENERATION_TIMEOUT_S:g} s"
        text = job.target.tokenizer.decode(recorder.token_ids)
    except Exception as failure:
        logger.exception("the outcome of session %s could not be computed", job.session.pk)
        return SessionEnd(job, recorder, status, finish_reason, error, event=event,
                          failure=f"{type(failure).__name__}: {failure}")
    return SessionEnd(job, recorder, status, finish_reason, error, text=text, stats=stats, event=event)


def write_end(end: SessionEnd, failure: str = "") -> None:
    """Writer thread: write the session's outcome (failed, after any ``failure``), record its
    metrics, end its trace, wake its task thread."""
    job, status = end.job, end.status
    try:
        failure = failure or end.failure
        written = "" if failure else write_outcome(end)
        if written is None:
            status = SUPERSEDED  # a later run owns the session: this one writes and observes nothing
        elif failure or written:
            status = SessionStatus.FAILED
            mark_failed(end, failure or written)
    finally:
        if status != SUPERSEDED:
            observe_end(end, status)
        if status in (SessionStatus.SUCCEEDED, SessionStatus.CANCELLED):
            # this node's prefix cache holds the context now: its next turn is routed here
            affinity.record(job.session.target_id, job.request.cache_scope,
                            list(job.request.prompt_ids) + list(end.recorder.token_ids))
        if job.trace is not None:
            job.trace.end(status)
        job.status = status
        job.done.set()


def write_outcome(end: SessionEnd) -> str | None:
    """The session's outcome and, once the fenced end wrote a success, its prediction; what
    failed, "", or None when the run's fence was stale (nothing written)."""
    job, recorder = end.job, end.recorder
    try:
        # a try whose commit went through but whose answer was lost finds the session ended: None
        written = database_retry.retrying(
            lambda: end_session(job.session, end.status, error=end.error, finish_reason=end.finish_reason,
                                token_ids=recorder.token_ids, text=end.text, stats=end.stats,
                                next_step=recorder.step),
            f"writing the end of session {job.session.pk}")
        if written is None:  # stale, or ended by another hand: this run's result is not the session's
            return None
        if written == SessionStatus.SUCCEEDED:
            from inference import prediction_cache

            prediction_cache.remember_result(job.session, text=end.text, token_count=len(recorder.token_ids),
                                             finish_reason=end.finish_reason, stats=end.stats or {})
            job.session.status = written
            canary.offer(job.session)  # a share of greedy generations is replayed target-only
    except Exception as error:
        logger.exception("recording the end of session %s failed", job.session.pk)
        close_old_connections()
        return f"{type(error).__name__}: {error}"
    return ""


def mark_failed(end: SessionEnd, failure: str) -> None:
    """Still end the session (its committed rows stay), so no client waits for a done event."""
    try:
        finish_session(end.job.session, SessionStatus.FAILED, finish_reason=end.finish_reason,
                       error=f"recording the outcome failed: {failure}", next_step=end.recorder.step)
    except Exception:
        logger.exception("session %s could not be marked failed", end.job.session.pk)
        close_old_connections()


def observe_end(end: SessionEnd, status: str) -> None:
    job, recorder, event = end.job, end.recorder, end.event
    drafter = event.drafter if event is not None and event.drafter else job.request.drafter
    # from the session's creation: what the client waits, the broker's queue included
    now = time.time()
    created = job.session.created_at.timestamp()
    ttft = recorder.step_times[0] - created if recorder.step_times else None
    queue_seconds = (recorder.admitted_at - created) if recorder.admitted_at else None
    metrics.observe_request(
        job.model_name, drafter, status, queue_seconds=queue_seconds, ttft_seconds=ttft,
        inter_token_seconds=metrics.inter_token_gaps(recorder.step_times, recorder.step_tokens),
        e2e_seconds=now - created, new_tokens=len(recorder.token_ids))
    if recorder.step_times and recorder.admitted_at:  # the latency budget's "inference"
        latency_budget.observe("inference", max(0.0, recorder.step_times[0] - recorder.admitted_at))
    if event is not None:
        stats = event.stats
        drafts = stats.drafted_per_position[0] if stats.drafted_per_position else 0
        metrics.observe_speculation(drafter, stats.drafted_per_position,
                                    stats.accepted_per_position, drafts)
        metrics.observe_schedule(drafter, stats.verified_lengths, stats.expected_accepted,
                                 stats.scheduled_accepted)


# -- no worker will finish it (the reconciler) --------------------------------------------

class EnqueueFailed(Exception):
    """The broker refused a re-enqueued session's task: it stays queued (see `requeue`)."""


def requeue(pk, queue: str, condition: Q, now: datetime, *, next_fence: int | None = None, **fields) -> bool:
    """Mark the session enqueued now (if ``condition`` still holds), then send it a task.

    ``next_fence`` (a lost run's session: its attempts + 1) is recorded on its stream first, so
    the lost run, should it wake up, streams nothing before the next claim. False when a worker
    claimed or finished it meanwhile; `EnqueueFailed` when the broker refuses the task (the
    session stays queued, so a later pass sends it again).
    """
    if not Session.objects.filter(condition, pk=pk).update(enqueued_at=now, updated_at=now, **fields):
        return False
    invalidate_session(pk)
    if next_fence is not None:
        token_stream.raise_fence(pk, next_fence)
    try:
        # ignore_result: the session row is the outcome (as generations.submit_generation sends it)
        current_app.send_task(GENERATE_TASK, args=[str(pk)], queue=queue, ignore_result=True)
    except Exception as error:
        raise EnqueueFailed(f"enqueue of session {pk} failed") from error
    return True


def fail_abandoned(pk, condition: Q, error: str, now: datetime, worker: str) -> bool:
    """Fail the session if ``condition`` still holds; True when this call ended it.

    The condition is checked under the row's lock in the transaction that writes the end, so no
    worker can claim it in between; the end is written once and its stream ended (with the
    session's current fence, sealing it against any older run's late publish).
    """
    session = Session.objects.filter(pk=pk).first()
    if session is None:
        return False
    Session.objects.filter(condition, pk=pk).update(worker=worker)
    return end_session(session, SessionStatus.FAILED, error=error, abandoned=condition) is not None
