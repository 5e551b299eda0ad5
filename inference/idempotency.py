"""``Idempotency-Key`` on generation POSTs: a retried request gets the session its first try made.

A client that lost the answer to its POST (a timeout, a dropped connection) cannot tell whether a
generation was made; retried without a key, it makes a second one. With the header, the first
request *claims* the key for its caller (the token's user) and records the session it made; a
retry with the same key and the same body, from the same caller, is answered from that session
(the REST API: the first answer's status and URLs; the OpenAI API: the session's reply, streamed
or whole, from its start). The same key with a different body is a 422 that names the header; a
retry while the first try is still being submitted is a 409 with ``Retry-After``.

Races: the claim is one ``INSERT ... ON CONFLICT`` on the (user, key) unique constraint, so of two
concurrent tries exactly one claims the key. A claim whose request was refused (a 4xx, a quota)
is released (the key may be used again); a claim its web process never completed (it died) is
taken over after ``STALE_CLAIM_S``. Keys live ``IDEMPOTENCY_KEY_TTL_S`` (a day, by the database's
clock); the reconciler deletes expired rows (``purge_expired``). The body is compared as sent,
byte for byte (a SHA-256 of the endpoint and the body): a retry sends what it sent.
"""
from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

from django.db import connections

from inference.limits import IDEMPOTENCY_KEY_TTL_S, MAX_IDEMPOTENCY_KEY_CHARS
from inference.models import IdempotencyKey

HEADER = "Idempotency-Key"
META_KEY = "HTTP_IDEMPOTENCY_KEY"
REPLAYED_HEADER = "Idempotent-Replayed"
STALE_CLAIM_S = 60  # a submission takes milliseconds; a claim this old lost its request
RETRY_AFTER_S = 1
PURGE_BATCH = 1000
PRIMARY = "default"  # a claim reads what it has just written: never a replica


class IdempotencyRefused(Exception):
    """The key cannot be used for this request: ``status`` (400, 409, 422), a message naming the header."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.retry_after_s = RETRY_AFTER_S if status == 409 else None


@dataclass(frozen=True)
class Claim:
    """This request holds the key: ``complete`` it with the session made, or ``release`` it."""

    user_id: int
    key: str
    token: uuid.UUID

    def complete(self, session_id, status_code: int) -> None:
        IdempotencyKey.objects.using(PRIMARY).filter(user_id=self.user_id, key=self.key, claim=self.token).update(
            session_id=session_id, status_code=status_code)

    def release(self) -> None:
        IdempotencyKey.objects.using(PRIMARY).filter(user_id=self.user_id, key=self.key, claim=self.token,
                                                     session_id__isnull=True).delete()


@dataclass(frozen=True)
class Replay:
    """The key's first request made ``session_id`` and was answered ``status_code``."""

    session_id: uuid.UUID
    status_code: int


def key_of(meta: dict) -> str | None:
    """The request's ``Idempotency-Key`` (None: not sent); a malformed one is refused (400)."""
    value = meta.get(META_KEY)
    if value is None:
        return None
    if not 1 <= len(value) <= MAX_IDEMPOTENCY_KEY_CHARS or not all(" " <= c <= "~" for c in value):
        raise IdempotencyRefused(400, f"{HEADER}: must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII "
                                 f"characters; got {len(value)} characters.", "invalid_idempotency_key")
    return value


def fingerprint(endpoint: str, body: bytes) -> str:
    return hashlib.sha256(endpoint.encode() + b"\0" + body).hexdigest()


_CLAIM_SQL = f"""
INSERT INTO {IdempotencyKey._meta.db_table} AS k
    (user_id, key, fingerprint, claim, session_id, status_code, created_at, expires_at)
VALUES (%s, %s, %s, %s, NULL, NULL, statement_timestamp(), statement_timestamp() + make_interval(secs => %s))
ON CONFLICT (user_id, key) DO UPDATE
    SET fingerprint = EXCLUDED.fingerprint, claim = EXCLUDED.claim, session_id = NULL, status_code = NULL,
        created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
    WHERE k.expires_at <= statement_timestamp()
       OR (k.session_id IS NULL AND k.created_at < statement_timestamp() - make_interval(secs => %s))
RETURNING claim
"""


def claim(user_id: int, key: str, endpoint: str, body: bytes) -> Claim | Replay:
    """Claim ``key`` for this request, or say what its first request made.

    Raises ``IdempotencyRefused``: 422 when the key was used with another body (or endpoint),
    409 while the first request holding it is still being submitted.
    """
    token, digest = uuid.uuid4(), fingerprint(endpoint, body)
    for _ in range(3):  # a key released between the INSERT and the read is free again: claim it
        with connections[PRIMARY].cursor() as cursor:
            cursor.execute(_CLAIM_SQL, [user_id, key, digest, token, IDEMPOTENCY_KEY_TTL_S, STALE_CLAIM_S])
            if cursor.fetchone() is not None:
                return Claim(user_id, key, token)
        row = (IdempotencyKey.objects.using(PRIMARY).filter(user_id=user_id, key=key)
               .values("fingerprint", "session_id", "status_code").first())
        if row is not None:
            break
    else:
        row = {"fingerprint": digest, "session_id": None}
    if row["fingerprint"] != digest:
        raise IdempotencyRefused(422, f"{HEADER}: this key was used with a different request body (or "
                                 "endpoint); send a new key for a new request.", "idempotency_key_reused")
    if row["session_id"] is None:
        raise IdempotencyRefused(409, f"{HEADER}: the first request with this key is still being submitted; "
                                 f"retry in {RETRY_AFTER_S} s.", "idempotency_key_in_use")
    return Replay(row["session_id"], row["status_code"])


def purge_expired(limit: int = PURGE_BATCH) -> int:
    """Delete up to ``limit`` expired keys (the reconciler's pass); how many were deleted."""
    table = IdempotencyKey._meta.db_table
    with connections[PRIMARY].cursor() as cursor:
        cursor.execute(f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table} WHERE expires_at <= statement_timestamp() "
                       "LIMIT %s)", [limit])
        return cursor.rowcount
