"""Run one session in a worker: claim it, prepare it, hand it to the device's batching loop, wait.

Called by the Celery task on a thread of the worker's threads pool. The task first claims the
session (an UPDATE that succeeds only when the session is queued, or running with an expired
lease), so two deliveries of one session never run it twice at once; the batching loop renews
the lease while the session is in its batch. Everything that can be checked before the loop is
checked here (the models load, the prompt tokenizes). A redelivered or re-enqueued session
resumes: its committed tokens are prefilled with the prompt and never generated again, and its
stream continues after the committed steps.
"""
from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

from django.db import connections
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from inference.conf import conf
from inference.engine import DRAFTERS, DraftConfig, GenerationConfig
from inference.engine.batch.engine import BatchRequest
from inference.worker import metrics, suffix_feed
from inference.worker.batching_loop import device_loop
from inference.worker.recording import TERMINAL, SessionRecorder, finish_session
from inference.worker.residency import residency
from inference.worker.session_job import SessionJob
from metadata.models import Session, SessionStatus, TokenRecord
from metadata.sessions import token_stream
from metadata.sessions.state import invalidate_session

logger = logging.getLogger(__name__)
# how long a task thread waits past the session's own deadline before it gives up on the loop
WAIT_MARGIN_S = 60.0


def generation_config(params: dict, eos_token_id: int | None) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=params["max_new_tokens"],
        temperature=params.get("temperature", 0.0),
        top_k=params.get("top_k", 0),
        top_p=params.get("top_p", 1.0),
        seed=params.get("seed"),
        stop_strings=tuple(params.get("stop", ())),
        eos_token_id=eos_token_id,
    )


def draft_config(drafter: str, params: dict) -> DraftConfig:
    """The drafter's settings from the request's parameters (older rows may carry extra keys)."""
    return DRAFTERS[drafter].draft_config(params, strict=False)


def committed_tokens(session: Session) -> tuple[list[int], int]:
    """The session's committed tokens (the gap-free prefix from position 0) and the next step."""
    rows = (TokenRecord.objects.filter(session_id=session.pk, session_created_at=session.created_at)
            .order_by("position").values_list("position", "token_id", "step"))
    tokens, next_step = [], 0
    for position, token_id, step in rows:
        if position != len(tokens):
            break
        tokens.append(token_id)
        next_step = step + 1
    return tokens, next_step


def claim(session: Session) -> bool:
    """Take the session's lease: only when it is queued, or running with a lapsed lease."""
    now = timezone.now()
    lapsed = Q(status=SessionStatus.RUNNING) & (Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now))
    claimed = Session.objects.filter(Q(status=SessionStatus.QUEUED) | lapsed, pk=session.pk).update(
        status=SessionStatus.RUNNING, started_at=Coalesce(F("started_at"), Value(now)),
        updated_at=now, last_activity_at=now, lease_expires_at=now + timedelta(seconds=conf.SESSION_LEASE_S),
        worker=socket.gethostname(), attempts=F("attempts") + 1)
    invalidate_session(session.pk)
    return bool(claimed)


def renew_lease(session: Session) -> None:
    now = timezone.now()
    Session.objects.filter(pk=session.pk, status=SessionStatus.RUNNING).update(
        lease_expires_at=now + timedelta(seconds=conf.SESSION_LEASE_S), last_activity_at=now)


def prepare(session: Session) -> SessionJob:
    """Load the session's models and build its batch request (errors here fail the session)."""
    target = residency.get(session.target)
    draft = residency.get(session.draft) if session.draft else None
    tokenizer = target.tokenizer
    prompt_ids = tokenizer(session.prompt)["input_ids"]
    resumed, next_step = committed_tokens(session)
    token_stream.forget_after(session.pk, next_step - 1)  # steps streamed but never committed
    request = BatchRequest(
        request_id=session.pk, prompt_ids=prompt_ids,
        config=generation_config(session.params, tokenizer.eos_token_id),
        drafter=session.drafter, draft_config=draft_config(session.drafter, session.params),
        deadline=time.monotonic() + conf.GENERATION_TIMEOUT_S, resume_ids=tuple(resumed),
        corpus=suffix_feed.corpus_key(session))
    recorder = SessionRecorder(session, tokenizer.decode, token_ids=list(resumed), step=next_step)
    return SessionJob(session=session, request=request, target=target, draft=draft,
                      model_name=session.target.name, recorder=recorder)


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


def run_session(session_id) -> str:
    """Generate for ``session_id`` in the device's batch; return its final status."""
    session = Session.objects.select_related("target", "draft").get(pk=session_id)
    if session.status in TERMINAL:
        return session.status  # a redelivery of a finished task does nothing
    if not claim(session):
        return Session.objects.get(pk=session.pk).status  # another worker holds it
    session.refresh_from_db(fields=["attempts"])
    if session.attempts > conf.MAX_ATTEMPTS:
        finish_session(session, SessionStatus.FAILED,
                       error=f"gave up after {conf.MAX_ATTEMPTS} attempts (the worker was lost each time)")
        return SessionStatus.FAILED
    try:
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
    renew_lease(session)  # loading the models may have taken a while
    device_loop().submit(job)
    # The wait holds no database connection: with a pool per process, SPECOPS_MAX_BATCH waiting
    # threads would otherwise starve the batching loop's own writes.
    connections.close_all()
    if not job.done.wait(conf.GENERATION_TIMEOUT_S + WAIT_MARGIN_S):
        logger.error("session %s: the batching loop did not end it in time", session.pk)
        finish_session(session, SessionStatus.FAILED, error="the batching loop did not answer")
        return SessionStatus.FAILED
    suffix_feed.feed_finished(job)  # a success teaches its tenant's suffix index
    return job.status
