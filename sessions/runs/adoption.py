"""A run that takes a session over adopts the steps an earlier run streamed but never committed.

Each step's tokens go to the session's stream as soon as they are verified, and their rows
commit a flush later (the worker's recorder): a client may have been streamed steps that no row
holds when the run that made them dies, pauses past its lease or is cut off. Resuming from the committed
tokens alone made those positions again; a sampled run drew other tokens there, and a client
kept text the session never stored. So the claim of a new run reads, in the atomic step that
raises the stream's fence (token_stream.begin_run: the old run can stream nothing more), the
steps streamed past the committed ones; the new run writes their token rows under its own fence
and resumes after them. Until those rows land the stream is the record of those steps.

A session that ends with no run to end it (the reconciler fails it: its workers were lost too
often, or none took it) adopts the same way inside the transaction that writes its end
(`end_of_abandoned`), so a failed session too stores every token a client saw.

The stream does not carry a step's candidates (the drafted branches), so an adopted step has
token rows and no candidate rows.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from django.db import transaction
from redis.exceptions import RedisError

from metadata.history import BatchWriter, token_records
from metadata.models import Session, TokenKind, TokenRecord
from sessions.runs import database_retry
from sessions.runs.fencing import lock_owned
from sessions.streams import StreamEntry, token_stream

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdoptedSteps:
    """The streamed steps a run adopts: their tokens in order, and the step it resumes at."""

    token_ids: tuple[int, ...]
    next_step: int
    rows: tuple[TokenRecord, ...]


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


def adopted_steps(session: Session, entries: Sequence[StreamEntry], start: int, next_step: int,
                  decode: Callable[[list[int]], str]) -> AdoptedSteps:
    """The token rows of the streamed ``entries`` (consecutive ``tokens`` events from step
    ``next_step``, as begin_run returns them), placed after ``start`` committed tokens."""
    tokens: list[int] = []
    rows: list[TokenRecord] = []
    for entry in entries:
        step, token_ids = entry.data["step"], [int(token) for token in entry.data["token_ids"]]
        if step != next_step:  # begin_run adopts by entry id = step: the data says the same
            raise ValueError(f"stream entry {entry.id} carries step {step}, expected {next_step}")
        kinds = entry.data.get("kinds")
        if not isinstance(kinds, list) or len(kinds) != len(token_ids):
            kinds = [TokenKind.TARGET] * len(token_ids)  # an event that did not say
        rows += token_records(session, start + len(tokens), step, token_ids, kinds, decode)
        tokens += token_ids
        next_step += 1
    return AdoptedSteps(tuple(tokens), next_step, tuple(rows))


def write_adopted(session: Session, rows: Sequence[TokenRecord]) -> bool:
    """Commit the adopted steps' token rows under the run's fence; False when the run no longer
    owns the session (a later run claimed it: it adopts them in turn).

    ``ON CONFLICT DO NOTHING``: a try whose commit went through but whose answer was lost (or a
    row past a gap in the committed ones) writes nothing twice.
    """
    with transaction.atomic():
        if not lock_owned([(session.pk, session.attempts)]):
            return False
        writer = BatchWriter((TokenRecord,))
        for row in rows:
            writer.add(row)
        writer.flush()
    return True


def start_stream(session: Session, committed: list[int], next_step: int,
                 decode: Callable[[list[int]], str]) -> tuple[list[int], int]:
    """Begin this run on the session's stream; the tokens it resumes from and its next step.

    token_stream.begin_run records the run's fence (from then on an older run's late publish is
    refused) and returns, in the same atomic step, what older runs streamed after the committed
    tokens: clients may have seen it, so the run adopts it (`write_adopted`: its rows written
    under this run's fence) instead of generating those positions again.
    """
    start = database_retry.retrying(lambda: token_stream.begin_run(session.pk, session.attempts, next_step - 1),
                                    f"starting the stream of session {session.pk}", retry_on=(RedisError,))
    if start.stale:
        logger.warning("session %s: a later run began before run %d", session.pk, session.attempts)
        return committed, next_step
    if start.dropped:
        logger.warning("session %s: %d stream events after a gap in its steps dropped", session.pk, start.dropped)
    if not start.adopted:
        return committed, next_step
    adopted = adopted_steps(session, start.adopted, len(committed), next_step, decode)
    if not database_retry.retrying(lambda: write_adopted(session, adopted.rows),
                                   f"writing the adopted steps of session {session.pk}"):
        logger.warning("session %s: a later run began before run %d wrote its adopted steps",
                       session.pk, session.attempts)  # this run is stale: it leaves at its first renewal
    logger.info("session %s: run %d adopts %d streamed steps (%d tokens) after %d committed tokens",
                session.pk, session.attempts, len(start.adopted), len(adopted.token_ids), len(committed))
    return committed + list(adopted.token_ids), adopted.next_step


@dataclass(frozen=True)
class AbandonedEnd:
    """What an end no run writes stores (`end_of_abandoned`): every token, the step after them,
    and the fence its ``done`` carries (the stream's, now above the lost run's)."""

    token_ids: list[int]
    text: str
    next_step: int
    fence: int
    adopted: bool


@functools.lru_cache(maxsize=8)
def _tokenizer(directory: str):
    """A model's tokenizer, kept: one reconciler pass may end hundreds of sessions of one model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def end_of_abandoned(session: Session) -> AbandonedEnd | None:
    """Inside the transaction that ends a session no run owns (the reconciler's, under the row's
    lock): adopt what its last run streamed past the committed tokens, so the failed session
    stores every token a client saw. The stream's fence goes to the next claim's (``attempts +
    1``), so the lost run, should it wake, streams nothing after the end.

    None (nothing read or written) when this process cannot decode the session's tokens: the
    tokenizer of its model is not on this host.
    """
    try:
        decode = _tokenizer(str(session.target.directory)).decode
    except Exception:  # a reconciler on a host without the model's files: the committed tokens stay the record
        logger.exception("session %s: no tokenizer here to adopt its streamed steps", session.pk)
        return None
    fence = session.attempts + 1
    committed, next_step = committed_tokens(session)
    start = token_stream.begin_run(session.pk, fence, next_step - 1)
    if start.stale or not start.adopted:
        return AbandonedEnd(committed, "", next_step, fence, adopted=False)
    adopted = adopted_steps(session, start.adopted, len(committed), next_step, decode)
    writer = BatchWriter((TokenRecord,))
    for row in adopted.rows:
        writer.add(row)
    writer.flush()
    tokens = committed + list(adopted.token_ids)
    logger.info("session %s: its end adopts %d streamed steps (%d tokens) after %d committed tokens",
                session.pk, len(start.adopted), len(adopted.token_ids), len(committed))
    return AbandonedEnd(tokens, decode(tokens), adopted.next_step, fence, adopted=True)
