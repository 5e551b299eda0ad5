"""Run one session's generation in a worker: decode, stream, and record the metadata.

Every verification step's tokens go to the session's stream at once; token and candidate rows are
buffered and written in batches (metadata.sessions.writers); the session row is updated once per batch of
tokens and at the end, never once per token.
"""
from __future__ import annotations

import logging
import time

from django.db import transaction
from django.utils import timezone

from inference import prediction_cache
from inference.engine import (
    DraftConfig,
    GenerationConfig,
    SpeculativeDecoder,
    build_drafter,
)
from inference.worker.metrics import observe_generation
from inference.worker.residency import residency
from metadata.models import Candidate, Session, SessionStatus, TokenKind, TokenRecord
from metadata.sessions import token_stream
from metadata.sessions.state import invalidate_session
from metadata.sessions.writers import BufferedWriter

logger = logging.getLogger(__name__)


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


class SessionRecorder:
    """Buffer one session's token and candidate rows and keep its running text."""

    def __init__(self, session: Session, decode) -> None:
        self.session = session
        self.decode = decode
        self.tokens = BufferedWriter(TokenRecord)
        self.candidates = BufferedWriter(Candidate)
        self.token_ids: list[int] = []
        self.step = 0

    def record_step(self, step) -> None:
        start = len(self.token_ids)
        written_before = self.tokens.written
        self.token_ids.extend(step.token_ids)
        for offset, token_id in enumerate(step.token_ids):
            if step.drafted == 0:
                kind = TokenKind.TARGET
            else:
                kind = TokenKind.ACCEPTED if offset < step.accepted else TokenKind.BONUS
            self.tokens.add(
                TokenRecord(
                    session_id=self.session.pk, session_created_at=self.session.created_at,
                    position=start + offset, step=self.step, token_id=token_id,
                    piece=self.decode([token_id]), kind=kind, logprob=None,
                )
            )
        for branch_no, branch in enumerate(step.branches):
            self.candidates.add(
                Candidate(
                    session_id=self.session.pk, session_created_at=self.session.created_at,
                    step=self.step, branch=branch_no, token_ids=list(branch.token_ids),
                    score=float(branch.score), accepted_len=branch.accepted_len,
                )
            )
        token_stream.publish(self.session.pk, "tokens", {"step": self.step, "token_ids": list(step.token_ids),
                                                         "text": self.decode(list(step.token_ids))})
        self.step += 1
        if self.tokens.written != written_before:  # a batch of tokens was just committed
            self.save_progress()

    def save_progress(self) -> None:
        now = timezone.now()
        Session.objects.filter(pk=self.session.pk).update(
            token_count=len(self.token_ids), text=self.decode(self.token_ids), updated_at=now, last_activity_at=now,
        )
        invalidate_session(self.session.pk)

    def flush(self) -> None:
        self.tokens.flush()
        self.candidates.flush()


def run_session(session_id) -> str:
    """Generate for ``session_id``; return its final status. Safe to run again after a crash."""
    session = Session.objects.select_related("target", "draft").get(pk=session_id)
    if session.status in (SessionStatus.SUCCEEDED, SessionStatus.FAILED, SessionStatus.CANCELLED):
        return session.status  # a redelivery of a finished task does nothing
    now = timezone.now()
    Session.objects.filter(pk=session.pk).update(status=SessionStatus.RUNNING, started_at=now, updated_at=now)
    invalidate_session(session.pk)
    started = time.perf_counter()
    try:
        target = residency.get(session.target)
        draft = residency.get(session.draft) if session.draft else None
        tokenizer = target.tokenizer
        decoder = SpeculativeDecoder(
            target=target.model,
            drafter=build_drafter(session.drafter, target=target.model, draft=draft.model if draft else None,
                                  config=draft_config(session.params)),
            decode=tokenizer.decode,
        )
        recorder = SessionRecorder(session, tokenizer.decode)
        prompt_ids = tokenizer(session.prompt)["input_ids"]
        finish_reason = None
        for step in decoder.stream(prompt_ids, generation_config(session.params, tokenizer.eos_token_id)):
            recorder.record_step(step)
            finish_reason = step.finish_reason or finish_reason
        recorder.flush()
    except Exception as exc:
        logger.exception("session %s failed", session.pk)
        _finish(session, SessionStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
        observe_generation(session.drafter, SessionStatus.FAILED, time.perf_counter() - started, None)
        raise
    stats, text = decoder.stats.to_dict(), tokenizer.decode(recorder.token_ids)
    _finish(session, SessionStatus.SUCCEEDED, finish_reason=finish_reason or "length",
            token_ids=recorder.token_ids, text=text, stats=stats)
    prediction_cache.remember_result(session, text=text, token_count=len(recorder.token_ids),
                                     finish_reason=finish_reason or "length", stats=stats)
    observe_generation(session.drafter, SessionStatus.SUCCEEDED, time.perf_counter() - started, stats)
    return SessionStatus.SUCCEEDED


def _finish(session: Session, status: str, error: str = "", finish_reason: str = "", token_ids=None,
            text: str | None = None, stats: dict | None = None) -> None:
    now = timezone.now()
    fields = {"status": status, "error": error, "finish_reason": finish_reason, "finished_at": now,
              "updated_at": now, "last_activity_at": now}
    if token_ids is not None:
        fields.update(token_count=len(token_ids), text=text, stats=stats or {})
    with transaction.atomic():
        Session.objects.filter(pk=session.pk).update(**fields)
        invalidate_session(session.pk)  # runs after the commit
    token_stream.publish(session.pk, "done", {"status": status, "finish_reason": finish_reason, "error": error})
