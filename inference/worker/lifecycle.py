"""A session's run in a device worker: claim, prepare, hand to the batch, end.

- Claim: the task takes the session's lease and the run's fence (``sessions.runs.claim_session``:
  an UPDATE that succeeds only when the session is queued, or running with an expired lease, so
  two deliveries of one session never run it twice at once); every write of the run carries the
  fence. The lease is renewed while the models load (``LeaseKeeper``), then by the batching loop.
- Prepare: everything that can be checked before the loop is checked here (the models load, the
  prompt tokenizes). A redelivered or re-enqueued session resumes: its committed tokens, and the
  steps an earlier run streamed after them (adopted: a client may have seen them), are prefilled
  with the prompt and never generated again, and its stream continues after them.
- Run: `run_session` hands the `SessionJob` to the device's batching loop (``hand_over``) and
  waits on ``job.done``.
- End: every end is written by ``sessions.runs.end_session``, once. A session that leaves the
  batch is ended in two halves: the loop thread computes its outcome (`session_end`), and an end
  writer thread writes it after the flush of its rows (`write_end`): the end, the prediction
  cache for a success, the request's metrics, the trace's end, and last ``job.done``, which wakes
  the task thread (Celery's late ack then means "written"). The claim, the flushes and the end
  are tried again while PostgreSQL is out of reach (``database_retry``); a write that still fails
  ends the session, as failed. The task ends the sessions that never reach the loop or that the
  loop never answers; the reconciler ends or re-enqueues the sessions no worker will finish.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.db import close_old_connections, connections
from django.db.models import Q

from core import latency_budget
from inference import affinity
from inference.conf import conf
from inference.engine.batch.engine import BatchRequest
from inference.prefix_scope import session_cache_scope
from inference.worker import canary, metrics, suffix_feed
from inference.worker.recorder import SessionRecorder
from inference.worker.residency import residency
from inference.worker.session_job import SessionEnd, SessionJob
from inference.worker.session_params import draft_config, generation_config, is_deterministic
from metadata.models import Session, SessionStatus
from sessions.runs import (
    SUPERSEDED,
    LeaseKeeper,
    claim_session,
    committed_tokens,
    database_retry,
    end_session,
    hand_over,
    start_stream,
)
from sessions.submission import prediction_cache

if TYPE_CHECKING:
    from inference.engine.batch.engine import RowEvent

logger = logging.getLogger(__name__)

# how long a task thread waits past the session's own deadline before it gives up on the loop
WAIT_MARGIN_S = 60.0


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
                    unowned=Q(status=SessionStatus.RUNNING, attempts=session.attempts))
        return SessionStatus.FAILED
    try:
        with LeaseKeeper(session):
            job = prepare(session)
    except Exception as exc:
        logger.exception("session %s could not start", session.pk)
        end_session(session, SessionStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
        metrics.observe_generation(session.drafter, SessionStatus.FAILED, 0.0, None)
        raise
    reason = finished_before(job)
    if reason is not None:
        tokens = job.recorder.token_ids
        end_session(session, SessionStatus.SUCCEEDED, finish_reason=reason, token_count=len(tokens),
                    text=job.target.tokenizer.decode(tokens), stats={"resumed_tokens": len(tokens)},
                    next_step=job.recorder.step)
        return SessionStatus.SUCCEEDED
    if not hand_over(session, lambda: submit(job), claimed_at=claimed_at):
        logger.warning("session %s: run %d was taken over while it prepared", session.pk, session.attempts)
        return SUPERSEDED
    # The wait holds no database connection: with a pool per process, SPECOPS_MAX_BATCH waiting
    # threads would otherwise starve the batching loop's own writes.
    connections.close_all()
    if not job.done.wait(conf.GENERATION_TIMEOUT_S + WAIT_MARGIN_S):
        logger.error("session %s: the batching loop did not end it in time", session.pk)
        end_session(session, SessionStatus.FAILED, error="the batching loop did not answer")
        return SessionStatus.FAILED
    suffix_feed.feed_finished(job)  # a success teaches its tenant's suffix index
    return job.status


# -- end ----------------------------------------------------------------------------------

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
            logger.warning("session %s: run %d is stale (a later run took it over); its end is not written",
                           job.session.pk, job.fence)
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
                                token_count=len(recorder.token_ids), text=end.text, stats=end.stats,
                                next_step=recorder.step),
            f"writing the end of session {job.session.pk}")
        if written is None:  # stale, or ended by another hand: this run's result is not the session's
            return None
        if written == SessionStatus.SUCCEEDED:
            prediction_cache.remember_result(job.session, deterministic=is_deterministic(job.session.params),
                                             text=end.text, token_count=len(recorder.token_ids),
                                             finish_reason=end.finish_reason, stats=end.stats or {})
            canary.offer(job.session)  # a share of greedy generations is replayed target-only
    except Exception as error:
        logger.exception("recording the end of session %s failed", job.session.pk)
        close_old_connections()
        return f"{type(error).__name__}: {error}"
    return ""


def mark_failed(end: SessionEnd, failure: str) -> None:
    """Still end the session (its committed rows stay), so no client waits for a done event."""
    try:
        end_session(end.job.session, SessionStatus.FAILED, finish_reason=end.finish_reason,
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
