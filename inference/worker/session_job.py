"""A session in the batching loop: the job a task thread hands over, and the job's end.

A task thread prepares a `SessionJob`, hands it to the loop and waits on ``job.done``. When its
row leaves the batch the loop thread computes its outcome (status, text, stats) into a
`SessionEnd` that holds a snapshot of its recorder, so nothing the writer reads changes under it.
The writer thread (write_behind.py) writes it after the flush of the session's rows:
`finish_session`, the prediction cache for a success, the request's metrics, the trace's end,
and last ``job.done``, which wakes the task thread (Celery's late ack then means "written"). A
write that fails still ends the session, as failed.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from django.db import close_old_connections

from inference.conf import conf
from inference.worker import metrics
from inference.worker.recording import SessionRecorder, finish_session
from metadata.models import Session, SessionStatus
from core import tracing
from core import latency_budget

if TYPE_CHECKING:
    from inference.engine.batch.engine import BatchRequest, RowEvent

logger = logging.getLogger(__name__)


@dataclass
class SessionJob:
    """A session handed to the loop, and how its task thread learns that it ended."""

    session: Session
    request: BatchRequest
    target: object  # LoadedModel
    draft: object | None
    model_name: str
    recorder: SessionRecorder
    done: threading.Event = field(default_factory=threading.Event)
    status: str = ""
    trace: tracing.SessionTrace | None = None  # its spans, while tracing is on (core.tracing)

    @property
    def pair(self) -> tuple[int, int | None]:
        return (self.session.target_id, self.session.draft_id)


@dataclass(frozen=True)
class SessionEnd:
    """A session that left the batch, as the loop thread hands it to the writer thread.

    ``failure`` says why its outcome could not be computed; the writer then marks it failed.
    """

    job: SessionJob
    recorder: SessionRecorder  # a snapshot: the loop thread keeps nothing of the session
    status: str
    finish_reason: str
    error: str
    text: str = ""
    stats: dict | None = None
    event: RowEvent | None = None  # its last step's (the engine has let go of its row)
    failure: str = ""


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
        failure = failure or end.failure or write_outcome(end)
        if failure:
            status = SessionStatus.FAILED
            mark_failed(end, failure)
    finally:
        observe_end(end, status)
        if job.trace is not None:
            job.trace.end(status)
        job.status = status
        job.done.set()


def write_outcome(end: SessionEnd) -> str:
    """The session's outcome and, for a success, its prediction; what failed, or ""."""
    job, recorder = end.job, end.recorder
    try:
        finish_session(job.session, end.status, error=end.error, finish_reason=end.finish_reason,
                       token_ids=recorder.token_ids, text=end.text, stats=end.stats, next_step=recorder.step)
        if end.status == SessionStatus.SUCCEEDED:
            from inference import prediction_cache

            prediction_cache.remember_result(job.session, text=end.text, token_count=len(recorder.token_ids),
                                             finish_reason=end.finish_reason, stats=end.stats or {})
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
