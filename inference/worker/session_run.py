"""Run one session in a worker: prepare it, hand it to the device's batching loop, wait for its end.

Called by the Celery task on a thread of the worker's threads pool. Everything that can be
checked before the loop is checked here (the session's models load, its prompt tokenizes); the
loop then runs it with every other session the process holds. Safe to run again after a crash:
a finished session is left alone, and a redelivered one writes nothing twice (rows are inserted
with ON CONFLICT DO NOTHING).
"""
from __future__ import annotations

import logging
import time

from django.utils import timezone

from inference.conf import conf
from inference.engine import DraftConfig, GenerationConfig
from inference.engine.batch import BatchRequest
from inference.worker import metrics
from inference.worker.batching_loop import SessionJob, device_loop
from inference.worker.recording import TERMINAL, SessionRecorder, finish_session
from inference.worker.residency import residency
from metadata.models import Session, SessionStatus
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


def draft_config(params: dict) -> DraftConfig:
    return DraftConfig(length=params.get("draft_length", 4))


def prepare(session: Session) -> SessionJob:
    """Load the session's models and build its batch request (errors here fail the session)."""
    target = residency.get(session.target)
    draft = residency.get(session.draft) if session.draft else None
    tokenizer = target.tokenizer
    prompt_ids = tokenizer(session.prompt)["input_ids"]
    request = BatchRequest(
        request_id=session.pk, prompt_ids=prompt_ids,
        config=generation_config(session.params, tokenizer.eos_token_id),
        drafter=session.drafter, draft_config=draft_config(session.params),
        deadline=time.monotonic() + conf.GENERATION_TIMEOUT_S)
    return SessionJob(session=session, request=request, target=target, draft=draft,
                      model_name=session.target.name,
                      recorder=SessionRecorder(session, tokenizer.decode))


def run_session(session_id) -> str:
    """Generate for ``session_id`` in the device's batch; return its final status."""
    session = Session.objects.select_related("target", "draft").get(pk=session_id)
    if session.status in TERMINAL:
        return session.status  # a redelivery of a finished task does nothing
    now = timezone.now()
    Session.objects.filter(pk=session.pk).update(status=SessionStatus.RUNNING, started_at=now,
                                                 updated_at=now)
    invalidate_session(session.pk)
    try:
        job = prepare(session)
    except Exception as exc:
        logger.exception("session %s could not start", session.pk)
        finish_session(session, SessionStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
        metrics.observe_generation(session.drafter, SessionStatus.FAILED, 0.0, None)
        raise
    device_loop().submit(job)
    if not job.done.wait(conf.GENERATION_TIMEOUT_S + WAIT_MARGIN_S):
        logger.error("session %s: the batching loop did not end it in time", session.pk)
        finish_session(session, SessionStatus.FAILED, error="the batching loop did not answer")
        return SessionStatus.FAILED
    return job.status
