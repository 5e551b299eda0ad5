"""The fault bench's view of a session (bench/faults.py): submit one, read its row, its token
rows and its stream, and judge how it ended against the unfaulted run of its prompt.

Every read is asked again while a service restarts under it (``wait``, ``read``): the bench
restarts PostgreSQL, Redis and the broker while sessions run.
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

TERMINAL = ("succeeded", "failed", "cancelled")


def new_client():
    """An API client of a fresh user and tenant: the prediction cache has nothing for it."""
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    from metadata.models import Tenant, TenantMembership

    name = f"faults-{secrets.token_hex(4)}"
    user = get_user_model().objects.create_user(name)
    TenantMembership.objects.create(user=user, tenant=Tenant.objects.create(name=name))
    client = APIClient()
    client.force_authenticate(user=user)
    return client


def submit(prompt: str, max_tokens: int) -> str:
    response = new_client().post("/api/v1/generations/", {"prompt": prompt, "max_new_tokens": max_tokens,
                                                          "drafter": "draft_model"}, format="json")
    if response.status_code != 202:
        raise SystemExit(f"generation refused or cached: {response.status_code} {response.content[:200]!r}")
    return str(response.json()["id"])


def session_row(session_id: str) -> dict:
    from metadata.models import Session

    return Session.objects.values("status", "token_count", "attempts", "error", "text", "worker",
                                  "finished_at").get(pk=session_id)


def committed(session_id: str) -> int:
    from metadata.models import TokenRecord

    return TokenRecord.objects.filter(session_id=session_id).count()


def token_rows(session_id: str) -> list[tuple[int, int]]:
    from metadata.models import TokenRecord

    return list(TokenRecord.objects.filter(session_id=session_id).order_by("position")
                .values_list("position", "token_id"))


def wait(probe, timeout: float, interval: float = 0.01):
    """Poll ``probe`` until it is truthy; a probe that fails because a service restarts under it
    (PostgreSQL, Redis) is asked again."""
    import redis
    from django.db import Error as DatabaseError, connection

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = probe()
        except (DatabaseError, redis.RedisError):
            connection.close()
            value = None
        if value:
            return value
        time.sleep(interval)
    return None


def read(probe, timeout: float = 60.0):
    """``probe()``, asked again while a service restarts under it."""
    result = wait(lambda: [probe()], timeout, interval=0.2)
    if result is None:
        raise SystemExit(f"no answer from the services for {timeout:.0f} s")
    return result[0]


def ended(session_id: str, timeout: float) -> bool:
    return bool(wait(lambda: session_row(session_id)["status"] in TERMINAL, timeout, interval=0.1))


@dataclass
class Outcome:
    """How one session ended, checked against the unfaulted run of its prompt."""

    session_id: str
    ended: bool
    status: str
    attempts: int
    rows_ok: bool  # positions 0..n-1, n == token_count, tokens equal the unfaulted run's
    lost_rows: int
    done_events: int
    repeated_steps: int
    duplicate_tokens: int = 0  # rows of a position another row has
    over_max: bool = False  # more tokens (rows or token_count) than max_new_tokens
    text_ok: bool = True  # the session's text is the unfaulted run's

    @property
    def ok(self) -> bool:
        return (self.ended and self.status == "succeeded" and self.rows_ok and self.done_events == 1
                and not self.duplicate_tokens and not self.over_max and self.text_ok)

    def line(self) -> str:
        return (f"status={self.status} attempts={self.attempts} rows_ok={self.rows_ok} lost_rows={self.lost_rows} "
                f"done_events={self.done_events} repeated_steps={self.repeated_steps} "
                f"duplicate_tokens={self.duplicate_tokens} over_max={self.over_max} text_ok={self.text_ok}")


def stream_counts(session_id: str) -> tuple[int, int]:
    """(``done`` events, ``tokens`` events of a step already seen) in the session's Redis stream."""
    from metadata.sessions import token_stream

    done, repeated, steps = 0, 0, set()
    for _entry_id, fields in token_stream.client().xrange(token_stream.stream_key(session_id)):
        event = fields[b"event"].decode()
        if event == "done":
            done += 1
        elif event == "tokens":
            step = json.loads(fields[b"data"])["step"]
            repeated += step in steps
            steps.add(step)
    return done, repeated


@dataclass
class Expected:
    """The unfaulted run of a prompt: its tokens and its text."""

    tokens: list[int]
    text: str


def outcome(session_id: str, expected: Expected, deadline: float, max_tokens: int, settle: float = 0.0) -> Outcome:
    """``settle``: seconds to wait after the session ended before reading it (a run woken after a
    pause or a partition would write then, if anything let it)."""
    has_ended = ended(session_id, deadline)
    time.sleep(settle)
    row = read(lambda: session_row(session_id))
    rows = read(lambda: token_rows(session_id))
    positions = [position for position, _ in rows]
    positions_ok = positions == list(range(len(rows))) and row["token_count"] == len(rows)
    tokens = [token for _, token in rows]
    # The final event goes out just after the final row commits: give it a moment.
    wait(lambda: stream_counts(session_id)[0], 5.0, interval=0.05)
    done, repeated = read(lambda: stream_counts(session_id))
    return Outcome(session_id, has_ended, row["status"], row["attempts"], positions_ok and tokens == expected.tokens,
                   max(0, len(expected.tokens) - len(rows)), done, repeated,
                   duplicate_tokens=len(positions) - len(set(positions)),
                   over_max=max(len(rows), row["token_count"]) > max_tokens, text_ok=row["text"] == expected.text)
