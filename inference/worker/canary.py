"""The losslessness canary: a share of finished generations replayed target-only, token for token.

Speculative decoding is only worth serving if it is lossless: a greedy generation must be exactly
the target's own greedy decoding, whatever the drafter, the batch or the scheduler did. The tests
prove it on the models they run; the canary checks it in production, on the models and traffic
that are really served. A finished greedy generation is chosen with probability
``SPECOPS_CANARY_SHARE`` (by a hash of its id, so a replayed task decides alike), and a task on its
model's device queue replays it with the target alone (`generate_plain`: no drafter, no batch)
and compares. Each outcome counts in ``specops_canary_replays_total{outcome}``; a mismatch also
writes a `CanaryMismatch` row (the admin shows both texts and the first differing position) and
the alert ``SpecOpsLosslessnessCanaryMismatch`` fires.

Sampled generations are not replayed: the rejection rule draws its randomness where the drafter
proposed, so a target-only run with the same seed follows the same distribution but not the same
draws; token-for-token comparison is a greedy property (the sampling tests check the rest).
"""
from __future__ import annotations

import logging
import zlib

from inference.conf import conf
from inference.models import CanaryMismatch
from inference.worker import metrics
from metadata.models import Session, SessionStatus, TokenRecord

logger = logging.getLogger(__name__)

MATCH, MISMATCH, SKIPPED = "match", "mismatch", "skipped"
REPLAY_TASK = "inference.canary_replay"  # by name: inference.tasks imports this module


def chosen(session: Session, share: float | None = None) -> bool:
    """Whether the canary replays this session: finished, greedy, speculative, and in the share."""
    share = conf.CANARY_SHARE if share is None else share
    if share <= 0 or session.status != SessionStatus.SUCCEEDED or session.drafter == "none":
        return False
    if float((session.params or {}).get("temperature", 0.0) or 0.0) != 0.0:
        return False
    return zlib.crc32(str(session.pk).encode()) % 10_000 < share * 10_000


def offer(session: Session) -> bool:
    """Enqueue the replay of a finished session when it is chosen; never raises (the session's
    end must not depend on the canary). Returns whether a replay was enqueued."""
    try:
        if not chosen(session):
            return False
        from celery import current_app

        current_app.send_task(REPLAY_TASK, args=[str(session.pk)], queue=session.queue)
        return True
    except Exception:  # a broker hiccup loses one canary sample, not a generation
        logger.warning("canary: could not enqueue the replay of session %s", session.pk, exc_info=True)
        return False


def first_difference(served: list[int], replayed: list[int]) -> int | None:
    """The first position where the two token lists differ (a missing token counts), or None."""
    for position, (a, b) in enumerate(zip(served, replayed)):
        if a != b:
            return position
    return None if len(served) == len(replayed) else min(len(served), len(replayed))


def replay(session_id: str, loaded=None, generate=None) -> str:
    """Replay one session target-only and record the outcome. ``loaded``: its target as the worker
    holds it (default: the resident copy); ``generate(loaded, prompt_ids, config)``: the target's
    greedy tokens where the engines run (batching_loop.DeviceBatchLoop.replay; default: here,
    with ``loaded``'s weights)."""
    from inference.worker.session_params import generation_config

    session = Session.objects.select_related("target").get(pk=session_id)
    if session.status != SessionStatus.SUCCEEDED:
        metrics.observe_canary(SKIPPED)
        return SKIPPED
    if loaded is None:
        from inference.worker.residency import residency

        loaded = residency.get(session.target)
    tokenizer = loaded.tokenizer
    served = list(TokenRecord.objects.filter(session_id=session.pk, session_created_at=session.created_at)
                  .order_by("position").values_list("token_id", flat=True))
    prompt_ids = tokenizer(session.prompt)["input_ids"]
    config = generation_config(session.params, tokenizer.eos_token_id)
    if generate is None:
        from inference.engine.decode.target_only import generate_plain

        replayed = generate_plain(loaded.model, prompt_ids, config, decode=tokenizer.decode).token_ids
    else:
        replayed = generate(loaded, prompt_ids, config)
    position = first_difference(served, replayed)
    if position is None:
        metrics.observe_canary(MATCH)
        return MATCH
    CanaryMismatch.objects.create(
        session_id=session.pk, session_created_at=session.created_at,
        model=f"{session.target.name}:{session.target.version}", drafter=session.drafter,
        first_difference=position, served_tokens=served, replayed_tokens=replayed,
        served_text=tokenizer.decode(served), replayed_text=tokenizer.decode(replayed))
    metrics.observe_canary(MISMATCH)
    logger.error("canary: session %s (%s, %s) differs from its target-only replay at position %d",
                 session.pk, session.target, session.drafter, position)
    return MISMATCH
