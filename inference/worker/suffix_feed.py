"""Feed the suffix drafter's corpora: from the sessions this worker finishes, and from the token
table when the worker starts.

The engine keeps one bounded index per opaque corpus key (inference/engine/drafters/suffix.py)
and knows no tenant. Here the key is (tenant id, target model version id): a session drafts
only from its own tenant's outputs, and token ids only mean the same under one tokenizer. What
goes in is a finished generation's tokens after the last `PROMPT_TAIL` tokens of its prompt
(`finished_sequence`), so a later request whose prompt ends alike finds the earlier answer's start.

Warm-up reads, per corpus of the models this process holds, the newest
`SPECOPS_SUFFIX_WARM_SESSIONS` succeeded sessions created within `SPECOPS_SUFFIX_WARM_AGE_S`
(one window query over the sessions, then their tokens in chunks), oldest first, so the index
ends up holding the newest. A failure is logged and leaves the index as it is: drafting from
nothing is slower, never wrong.
"""
from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from django.db.models import F, Window
from django.db.models.functions import RowNumber
from django.utils import timezone

from inference.conf import conf
from inference.engine.drafters.suffix import PROMPT_TAIL, SuffixCorpora, finished_sequence, suffix_corpora
from metadata.models import Session, SessionStatus, TokenRecord

if TYPE_CHECKING:
    from inference.worker.session_job import SessionJob

logger = logging.getLogger(__name__)

__all__ = ["PROMPT_TAIL", "corpus_key", "feed_finished", "warm_up"]

#: characters of a stored prompt tokenized at warm-up to find its last PROMPT_TAIL tokens
PROMPT_TAIL_CHARS = 1024
#: sessions whose tokens one warm-up query reads
TOKEN_QUERY_SESSIONS = 64


_feeding: SuffixCorpora | None = None  # where this process's engines draft from (feed_into)


def feed_into(corpora) -> None:
    """Feed ``corpora`` from now on (an engine core's, through its client) instead of this process's own."""
    global _feeding
    _feeding = corpora


def default_corpora():
    return suffix_corpora if _feeding is None else _feeding


def corpus_key(session: Session) -> Hashable:
    """The corpus a session drafts from and feeds: its tenant's, under its target's tokenizer."""
    return (session.tenant_id, session.target_id)


def feed_finished(job: SessionJob, corpora: SuffixCorpora | None = None) -> bool:
    """Index a generation that succeeded under its tenant's corpus; True when it was indexed."""
    tokens = job.recorder.token_ids
    if job.status != SessionStatus.SUCCEEDED or not tokens:
        return False
    corpora = default_corpora() if corpora is None else corpora
    corpora.add(corpus_key(job.session), finished_sequence(job.request.prompt_ids, tokens))
    return True


def recent_sessions(target_ids: Sequence[int], per_corpus: int, max_age_s: float,
                    limit: int, now: datetime | None = None) -> list[tuple]:
    """(id, created_at, tenant_id, target_id, prompt) of the newest succeeded sessions of each
    (tenant, target) among `target_ids`, at most `per_corpus` each and `limit` in all, oldest first."""
    cutoff = (now or timezone.now()) - timedelta(seconds=max_age_s)
    ranked = (Session.objects
              .filter(status=SessionStatus.SUCCEEDED, target_id__in=list(target_ids),
                      created_at__gte=cutoff, token_count__gt=0)
              .annotate(recency=Window(RowNumber(), partition_by=[F("tenant_id"), F("target_id")],
                                       order_by=[F("created_at").desc(), F("id").desc()]))
              .filter(recency__lte=per_corpus)
              .order_by("-created_at", "-id")
              .values_list("id", "created_at", "tenant_id", "target_id", "prompt"))
    return list(ranked[:limit])[::-1]


def committed_tokens(sessions: Sequence[tuple]) -> dict:
    """Each session's gap-free tokens from position 0 (one query for all of them)."""
    created = [row[1] for row in sessions]
    rows = (TokenRecord.objects
            .filter(session_id__in=[row[0] for row in sessions],
                    session_created_at__gte=min(created), session_created_at__lte=max(created))
            .order_by("session_id", "position")
            .values_list("session_id", "position", "token_id"))
    tokens: dict = {row[0]: [] for row in sessions}
    for session_id, position, token_id in rows:
        found = tokens[session_id]
        if position == len(found):
            found.append(token_id)
    return tokens


def warm_up(models: Mapping[int, object], *, per_corpus: int | None = None,
            max_age_s: float | None = None, corpora: SuffixCorpora | None = None,
            now: datetime | None = None) -> int:
    """Index recent outputs of the target versions in `models` ({version id: LoadedModel, whose
    tokenizer reads the stored prompts}); return how many sessions were indexed."""
    per_corpus = conf.SUFFIX_WARM_SESSIONS if per_corpus is None else per_corpus
    max_age_s = conf.SUFFIX_WARM_AGE_S if max_age_s is None else max_age_s
    corpora = default_corpora() if corpora is None else corpora
    if per_corpus <= 0 or not models:
        return 0
    try:
        sessions = recent_sessions(list(models), per_corpus, max_age_s,
                                   limit=per_corpus * corpora.max_corpora, now=now)
        fed = 0
        for start in range(0, len(sessions), TOKEN_QUERY_SESSIONS):
            chunk = sessions[start:start + TOKEN_QUERY_SESSIONS]
            tokens = committed_tokens(chunk)
            for session_id, _, tenant_id, target_id, prompt in chunk:
                if not tokens[session_id]:
                    continue
                tokenizer = models[target_id].tokenizer
                prompt_ids = tokenizer(prompt[-PROMPT_TAIL_CHARS:])["input_ids"]
                corpora.add((tenant_id, target_id), finished_sequence(prompt_ids, tokens[session_id]))
                fed += 1
    except Exception:  # drafting from an empty index is slower, never wrong
        logger.exception("warming the suffix index failed")
        return 0
    logger.info("suffix index warmed from %d session(s) into %d corpora", fed, len(corpora))
    return fed
