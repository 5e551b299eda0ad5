"""The fault bench's view of a session (bench/faults.py): submit one, read its row, its token
rows and its stream, and judge how it ended against the unfaulted run of its prompt (a greedy
session) and against what its stream client was streamed (every session).

Every read is asked again while a service restarts under it (``wait``, ``read``): the bench
restarts PostgreSQL, Redis and the broker while sessions run.
"""
from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.fault_streams import Streamed, is_prefix

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


def submit(prompt: str, max_tokens: int, *, sampled: bool = False, drafter: str = "draft_model") -> str:
    """A new session of a fresh tenant; greedy, or ``sampled`` (temperature 1, no seed)."""
    body = {"prompt": prompt, "max_new_tokens": max_tokens, "drafter": drafter}
    if sampled:
        body["temperature"] = 1.0
    response = new_client().post("/api/v1/generations/", body, format="json")
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
    text_ok: bool = True  # the session's text is the unfaulted run's (sampled: its rows' tokens decoded)
    sampled: bool = False
    stream_ok: bool = True  # what its stream client was streamed is a prefix of its stored tokens
    streamed: int = 0  # tokens its stream client was streamed
    stored: int = 0  # tokens its rows hold
    client_done: bool = False  # its stream client got the done event
    reopened: int = 0  # times its stream client opened the stream again (it broke, or went idle)

    @property
    def ok(self) -> bool:
        return (self.ended and self.status == "succeeded" and self.rows_ok and self.done_events == 1
                and not self.duplicate_tokens and not self.over_max and self.text_ok and self.stream_ok)

    def line(self) -> str:
        return (f"{'sampled' if self.sampled else 'greedy'} status={self.status} attempts={self.attempts} "
                f"rows_ok={self.rows_ok} lost_rows={self.lost_rows} "
                f"done_events={self.done_events} repeated_steps={self.repeated_steps} "
                f"duplicate_tokens={self.duplicate_tokens} over_max={self.over_max} text_ok={self.text_ok} "
                f"stream_ok={self.stream_ok} (client streamed {self.streamed} of {self.stored} tokens, "
                f"done {'seen' if self.client_done else 'not seen'}, stream opened again {self.reopened} times)")


def stream_counts(session_id: str) -> tuple[int, int]:
    """(``done`` events, ``tokens`` events of a step already seen) in the session's Redis stream."""
    from sessions.streams import token_stream

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


def outcome(session_id: str, expected: Expected | None, deadline: float, max_tokens: int, settle: float = 0.0,
            *, streamed: Streamed, decode: Callable[[list[int]], str]) -> Outcome:
    """How the session ended; ``expected`` None for a sampled session (no unfaulted run to match:
    its text must be its own rows' tokens decoded). ``streamed``: its stream client's, compared once
    the client got ``done`` (or gave up with the session). ``settle``: seconds to wait after the
    session ended before reading it (a run woken after a pause or a partition would write then,
    if anything let it)."""
    from metadata.history import pg_text

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
    streamed.ended.wait(30.0)
    seen = streamed.tokens
    expected_text = expected.text if expected is not None else pg_text(decode(tokens))
    return Outcome(session_id, has_ended, row["status"], row["attempts"],
                   positions_ok and (expected is None or tokens == expected.tokens),
                   max(0, len(expected.tokens) - len(rows)) if expected is not None else 0, done, repeated,
                   duplicate_tokens=len(positions) - len(set(positions)),
                   over_max=max(len(rows), row["token_count"]) > max_tokens, text_ok=row["text"] == expected_text,
                   sampled=expected is None, stream_ok=is_prefix(seen, tokens), streamed=len(seen),
                   stored=len(tokens), client_done=streamed.done is not None, reopened=streamed.reopened)


def progressed(session_id: str, tokens: int) -> bool:
    """The session committed ``tokens`` tokens, or ended (a sampled one may end early: the fault
    then comes too late and is run again)."""
    return committed(session_id) >= tokens or session_row(session_id)["status"] in TERMINAL


RESTARTS = ("restart_postgres", "restart_redis", "restart_broker")


def result_line(outcomes: dict[str, list[Outcome]]) -> str:
    """The bench's last line, from the outcomes by fault (a case not run is 0/0)."""
    def ok(*kinds: str) -> str:
        chosen = [o for kind in kinds for o in outcomes.get(kind, [])]
        return f"{sum(o.ok for o in chosen)}/{len(chosen)}"

    every = [o for by_kind in outcomes.values() for o in by_kind]
    duplicates = sum(o.repeated_steps + max(0, o.done_events - 1) for o in every)
    sampled = [o for o in every if o.sampled]
    return (f"RESULT kill_child_ok={ok('kill_child')} kill_worker_ok={ok('kill_worker')} "
            f"broker_flush_ok={ok('broker_flush')} duplicate_stream_events={duplicates} "
            f"lost_sessions={sum(not o.ended for o in every)} lost_rows={sum(o.lost_rows for o in every)} "
            f"pause_ok={ok('pause')} partition_ok={ok('partition')} restart_ok={ok(*RESTARTS)} "
            f"duplicate_tokens={sum(o.duplicate_tokens for o in every)} "
            f"over_max_tokens={sum(o.over_max for o in every)} "
            f"text_mismatch={sum(not o.text_ok for o in every)} "
            f"sampled_ok={sum(o.ok for o in sampled)}/{len(sampled)} "
            f"stream_mismatch={sum(not o.stream_ok for o in every)}")
