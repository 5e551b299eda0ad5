"""A session's generated tokens as the token table stores them.

PostgreSQL text cannot hold NUL (0x00), which a model may generate. Token ids are the truth; the
session's text column and each token's piece show NUL as U+2400 (SYMBOL FOR NULL) instead.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from metadata.models import Session, TokenRecord

NUL_IN_TEXT = "\u2400"


def pg_text(text: str) -> str:
    """`text` as PostgreSQL can store it: NUL shown as U+2400 (see NUL_IN_TEXT)."""
    return text.replace("\x00", NUL_IN_TEXT) if "\x00" in text else text


def token_records(session: Session, start: int, step: int, token_ids: Sequence[int], kinds: Sequence[int],
                  decode: Callable[[list[int]], str]) -> list[TokenRecord]:
    """The token rows of one step of ``session``: its tokens at positions ``start``, ``start + 1``, ..."""
    return [TokenRecord(session_id=session.pk, session_created_at=session.created_at, position=start + offset,
                        step=step, token_id=token_id, piece=pg_text(decode([token_id])), kind=kind, logprob=None)
            for offset, (token_id, kind) in enumerate(zip(token_ids, kinds, strict=True))]
