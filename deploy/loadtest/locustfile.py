"""SpecOps load test: the API paths a speculative-decoding client hammers, measured against the SLO.

Two kinds of users:

- ``GenerationUser`` creates a generation, follows the session's token stream to its first
  ``tokens`` event (the time to first token, reported as request type ``TTFT``), polls the
  session until it is done, then pages through its tokens with the keyset cursor (and reads the
  first page of candidates).
- ``BurstReader`` reads one session's state many times in a row, as a crowd of pollers does; this
  is the read path the two-tier cache and request coalescing exist for.

Run it through ``deploy/loadtest/run.sh`` (headless, bounded, SLO verdict per endpoint and on the
TTFT). Settings come from the environment: the tokens, ``SPECOPS_LOAD_TOKENS_FILE`` (one a line;
``run.sh`` makes one per user, each of a tenant of its own: ``manage.py loadtest_tenants``) or
else ``SPECOPS_TOKEN`` (one for every user), and the ``SPECOPS_LOAD_*`` variables below. Users
take the tokens in turn, so with as many tokens as users each calls with its own. Every URL the API returns
is reduced to its path, so requests only ever go to the host locust was given. The test stops by
itself after ``--run-time`` or after ``SPECOPS_LOAD_MAX_REQUESTS`` requests, whichever comes first.

The TTFT is the client's: from sending ``POST /api/v1/generations/`` to reading the first
``event: tokens`` of ``/api/v1/sessions/{id}/stream/`` (queue wait, prefill and the first step
included). The stream is read with a plain HTTP session, not locust's, so its connection time
does not land in the stats as a request of its own, and it is closed at the first token. Under
gunicorn's gthread workers each open stream holds a server thread, so at most
``SPECOPS_LOAD_MAX_STREAMS`` are open at once per locust process; a generation that finds them
all busy skips the TTFT (polling still measures it to the end).

The drafters come from the engine's registry (``inference.engine.drafters.DRAFTER_KINDS``), less
the kinds that are no drafter of their own (``auto`` lets the server's policy choose one).
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import gevent
import gevent.lock
import requests
from locust import HttpUser, between, events, task

# locust puts this file's folder on sys.path, not the repository's: the registry lives there.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from inference.engine.drafters import DRAFTER_KINDS

# That import (torch, transformers) blocks for seconds: refresh the clock gevent's loop caches,
# else locust's --run-time timer, set from the stale clock, fires as soon as the test starts.
gevent.get_hub().loop.update_now()

logger = logging.getLogger("specops.loadtest")

DEFAULT_HOST = "http://127.0.0.1:8000"
API = "/api/v1"
TERMINAL_STATUSES = ("succeeded", "failed")
# Kinds the registry may list that are no drafter of their own: "auto" asks the server's policy.
POLICY_KINDS = ("auto",)
REAL_DRAFTERS = tuple(kind for kind in DRAFTER_KINDS if kind not in POLICY_KINDS)
NEEDS_DRAFT_MODEL = tuple(kind for kind in ("draft_model", "tree") if kind in DRAFTER_KINDS)
NEEDS_DSPARK = tuple(kind for kind in ("dspark",) if kind in DRAFTER_KINDS)
TTFT_REQUEST_TYPE = "TTFT"
TTFT_NAME = f"{API}/generations/ (first token)"
PROMPTS = (
    "def parse(text):\n    ",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Cache:\n    def __init__(self, size):\n        ",
    "for key, value in sorted(items.items()):\n    ",
    '"""Return the number of lines in a file."""\n',
)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit(f"{name} must be a positive integer, got {raw!r}")
    return int(raw)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{name} must be a number, got {raw!r}") from None
    if value <= 0:
        raise SystemExit(f"{name} must be greater than 0, got {raw!r}")
    return value


def _env_share(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{name} must be a number from 0 to 1, got {raw!r}") from None
    if not 0 <= value <= 1:
        raise SystemExit(f"{name} must be a number from 0 to 1, got {raw!r}")
    return value


def _env_drafters() -> tuple[str, ...]:
    """The drafters to spread the generations over: the registry's real ones unless told.

    An explicit list may name any kind of the registry, ``auto`` included where it has one.
    """
    raw = os.environ.get("SPECOPS_LOAD_DRAFTERS", "")
    if not raw:
        return REAL_DRAFTERS
    drafters = tuple(d.strip() for d in raw.split(",") if d.strip())
    unknown = [d for d in drafters if d not in DRAFTER_KINDS]
    if not drafters or unknown:
        raise SystemExit(f"SPECOPS_LOAD_DRAFTERS must list some of {', '.join(DRAFTER_KINDS)}; got {raw!r}")
    return drafters


MAX_REQUESTS = _env_int("SPECOPS_LOAD_MAX_REQUESTS", 20_000)
MAX_NEW_TOKENS = _env_int("SPECOPS_LOAD_MAX_NEW_TOKENS", 16)
TOKEN_PAGE_SIZE = _env_int("SPECOPS_LOAD_TOKEN_PAGE_SIZE", 8)
BURST_READS = _env_int("SPECOPS_LOAD_BURST_READS", 20)
POLL_INTERVAL_S = _env_float("SPECOPS_LOAD_POLL_INTERVAL_S", 0.25)
GENERATION_TIMEOUT_S = _env_float("SPECOPS_LOAD_GENERATION_TIMEOUT_S", 60.0)
STREAM_SHARE = _env_share("SPECOPS_LOAD_STREAM_SHARE", 1.0)  # generations whose TTFT is measured
MAX_STREAMS = _env_int("SPECOPS_LOAD_MAX_STREAMS", 2)  # open streams at once (server threads held)
DRAFTERS = _env_drafters()

# Shared by the users of this process (gevent greenlets: no locking needed).
# Sessions by the token that made or listed them: a tenant's session is a 404 to every other tenant.
known_sessions: dict[str, deque[str]] = {}
generation_results: list[tuple[str, float, int]] = []  # (final status, seconds to done, tokens)
_request_count = itertools.count(1)
_stopping = False
_runner = None  # set at test start; the max-requests stop needs it
_stream_slots = gevent.lock.BoundedSemaphore(MAX_STREAMS)


def _load_tokens() -> list[str]:
    """The API tokens the users call with: SPECOPS_LOAD_TOKENS_FILE's lines, else SPECOPS_TOKEN."""
    path = os.environ.get("SPECOPS_LOAD_TOKENS_FILE", "")
    if path:
        try:
            tokens = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
        except OSError as exc:
            raise SystemExit(f"SPECOPS_LOAD_TOKENS_FILE: {exc}") from None
        return tokens
    token = os.environ.get("SPECOPS_TOKEN", "")
    return [token] if token else []


TOKENS = _load_tokens()
_next_token = itertools.cycle(TOKENS or [""])


class StreamError(Exception):
    """The stream ended, failed or stayed silent before its first tokens event."""


def path_of(url: str) -> str:
    """The path and query of an absolute URL the API returned, so traffic stays on our host."""
    parts = urlsplit(url)
    return parts.path + (f"?{parts.query}" if parts.query else "")


def describe(response) -> str:
    """Why a response failed, in one line: its status and body, or the connection error."""
    if not response.status_code:
        return f"no response: {response.error}"
    return f"HTTP {response.status_code}: {response.text[:200]}"


def with_query(path: str, **params: object) -> str:
    query = "&".join(f"{key}={value}" for key, value in params.items())
    return path + ("&" if "?" in path else "?") + query


def first_tokens_event(lines: Iterator[str], deadline: float) -> dict:
    """The data of the first ``tokens`` event of an SSE stream (``event: NAME`` then ``data: JSON``)."""
    event = "message"
    for line in lines:
        if time.monotonic() > deadline:
            raise StreamError(f"no tokens event after {GENERATION_TIMEOUT_S:g} s")
        if line.startswith("event:"):
            event = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data = json.loads(line[len("data:"):].strip() or "null")
            if event == "tokens":
                return data
            if event == "done":
                raise StreamError(f"stream done before any token: {json.dumps(data)[:200]}")
        elif not line:
            event = "message"  # a blank line ends an event
    raise StreamError("stream closed before any token")


@events.request.add_listener
def _stop_after_max_requests(**_kwargs) -> None:
    global _stopping
    if next(_request_count) >= MAX_REQUESTS and not _stopping and _runner is not None:
        _stopping = True
        logger.warning("reached SPECOPS_LOAD_MAX_REQUESTS=%d: stopping", MAX_REQUESTS)
        gevent.spawn(_runner.quit)  # not from this greenlet: quit() kills the users' greenlets


@events.test_start.add_listener
def _on_test_start(environment, **_kwargs) -> None:
    global _runner
    _runner = environment.runner
    if not TOKENS:
        logger.error("no API token: set SPECOPS_LOAD_TOKENS_FILE or SPECOPS_TOKEN (deploy/loadtest/run.sh makes them)")
        gevent.spawn(environment.runner.quit)


@events.quitting.add_listener
def _print_generation_summary(**_kwargs) -> None:
    done = [r for r in generation_results if r[0] == "succeeded"]
    if not generation_results:
        return
    seconds = sorted(r[1] for r in done)
    tokens = sum(r[2] for r in done)
    line = f"generations: {len(generation_results)} finished or timed out, {len(done)} succeeded"
    if seconds:
        p95 = seconds[min(len(seconds) - 1, int(0.95 * len(seconds)))]
        line += (f"; time to done p50 {statistics.median(seconds):.2f} s, p95 {p95:.2f} s; "
                 f"{tokens / sum(seconds):.1f} tokens/s per generation, queue wait included")
    print(line, flush=True)


class SpecOpsUser(HttpUser):
    """Token auth on every request; the host defaults to the local web process."""

    abstract = True
    host = DEFAULT_HOST

    def on_start(self) -> None:
        self.token = next(_next_token)  # each user its own, in turn
        self.client.headers["Authorization"] = f"Token {self.token}"

    def sessions(self) -> deque[str]:
        """The sessions this user's tenant has (those it made or listed)."""
        return known_sessions.setdefault(self.token, deque(maxlen=500))

    def remember(self, session_id: str) -> None:
        self.sessions().append(session_id)
        self.client.headers["Accept"] = "application/json"


class GenerationUser(SpecOpsUser):
    """Create → poll until done → page through tokens by cursor → first page of candidates."""

    weight = 1
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        super().on_start()
        self.drafters = self._usable_drafters()
        # The stream's own session: its connection must not count as an API request in the stats.
        self.stream_client = requests.Session()
        self.stream_client.headers.update(self.client.headers)

    def on_stop(self) -> None:
        self.stream_client.close()

    def _usable_drafters(self) -> tuple[str, ...]:
        """Leave out the drafters that need a draft model (a DSpark drafter) when no active target has one."""
        with self.client.get(f"{API}/models/", name=f"{API}/models/", catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"listing models: {describe(response)}")
                return DRAFTERS
            body = response.json()
        models = body.get("results", body) if isinstance(body, dict) else body
        targets = [m for m in models if m.get("role") == "target" and m.get("status") == "active"]
        if not targets:
            return DRAFTERS
        missing = set()
        if all(m.get("default_draft") is None for m in targets):
            missing.update(NEEDS_DRAFT_MODEL)
        if not any(m.get("has_dspark") for m in targets):
            missing.update(NEEDS_DSPARK)
        usable = tuple(d for d in DRAFTERS if d not in missing)
        return usable or DRAFTERS

    @task
    def generate(self) -> None:
        request = {
            "prompt": random.choice(PROMPTS), "max_new_tokens": MAX_NEW_TOKENS,
            "drafter": random.choice(self.drafters), "temperature": 0.0, "seed": random.randrange(2**31),
        }
        posted = time.monotonic()
        with self.client.post(f"{API}/generations/", json=request, name=f"{API}/generations/",
                              catch_response=True) as response:
            # 200: a deterministic request answered from the prediction cache, already done.
            if response.status_code not in (200, 202):
                response.failure(describe(response))
                return
            created = response.json()
        self.remember(str(created["id"]))
        if random.random() < STREAM_SHARE and _stream_slots.acquire(blocking=False):
            try:
                self._time_to_first_token(path_of(created["stream_url"]), posted)
            finally:
                _stream_slots.release()
        session = self._poll_until_done(path_of(created["url"]))
        if session is None:
            generation_results.append(("timeout", time.monotonic() - posted, 0))
            return
        generation_results.append((session["status"], time.monotonic() - posted, session["token_count"]))
        if session["status"] == "succeeded":
            self._page_tokens(path_of(created["tokens_url"]), expected=session["token_count"])
            self._first_candidates_page(str(created["id"]))

    def _time_to_first_token(self, stream_path: str, posted: float) -> None:
        """Report the time from the POST to the stream's first tokens event as a TTFT request."""
        error: Exception | None = None
        try:
            with self.stream_client.get(self.host.rstrip("/") + stream_path, stream=True,
                                        timeout=(5, GENERATION_TIMEOUT_S)) as response:
                if response.status_code != 200:
                    raise StreamError(describe(response))
                # chunk_size=1: iter_lines waits for a full chunk (512 bytes by default) before it
                # yields, and a first event is smaller; we stop at it, so bytewise reads cost little.
                lines = response.iter_lines(chunk_size=1, decode_unicode=True)
                first_tokens_event(lines, posted + GENERATION_TIMEOUT_S)
        except (requests.RequestException, StreamError, ValueError) as exc:
            error = exc if isinstance(exc, StreamError) else StreamError(f"{type(exc).__name__}: {exc}")
        self.environment.events.request.fire(
            request_type=TTFT_REQUEST_TYPE, name=TTFT_NAME, response_time=(time.monotonic() - posted) * 1000,
            response_length=0, exception=error, context={},
        )

    def _poll_until_done(self, session_path: str) -> dict | None:
        deadline = time.monotonic() + GENERATION_TIMEOUT_S
        while True:
            with self.client.get(session_path, name=f"{API}/sessions/[id]/", catch_response=True) as response:
                if response.status_code != 200:
                    response.failure(describe(response))
                    return None
                session = response.json()
                if session["status"] == "failed":
                    response.failure(f"generation failed: {(session.get('error') or '')[:200]}")
                    return session
                if session["status"] in TERMINAL_STATUSES:
                    return session
                if time.monotonic() > deadline:
                    response.failure(f"generation not done after {GENERATION_TIMEOUT_S:g} s "
                                     f"(status {session['status']}): is a worker consuming its queue?")
                    return None
            gevent.sleep(POLL_INTERVAL_S)

    def _page_tokens(self, tokens_path: str, expected: int) -> None:
        """Follow ``next`` to the end; positions must run 0, 1, 2, ... without gap or repeat."""
        url, positions = with_query(tokens_path, page_size=TOKEN_PAGE_SIZE), []
        while url:
            with self.client.get(url, name=f"{API}/sessions/[id]/tokens/", catch_response=True) as response:
                if response.status_code != 200:
                    response.failure(describe(response))
                    return
                page = response.json()
                positions.extend(row["position"] for row in page["results"])
                if page["next"] and not page["results"]:
                    response.failure("an empty page with a next cursor")
                    return
                if not page["next"] and positions != list(range(expected)):
                    response.failure(f"pages gave positions {positions[:5]}... ({len(positions)}), "
                                     f"want 0..{expected - 1}")
            url = path_of(page["next"]) if page["next"] else None

    def _first_candidates_page(self, session_id: str) -> None:
        self.client.get(f"{API}/sessions/{session_id}/candidates/?page_size=20",
                        name=f"{API}/sessions/[id]/candidates/")


class BurstReader(SpecOpsUser):
    """Read one of its tenant's sessions ``SPECOPS_LOAD_BURST_READS`` times back to back.

    The sessions are its tenant's (the list's first page); a tenant that has none yet gets one
    generation, whose state is then read whether or not a worker runs it.
    """

    weight = 1
    wait_time = between(0.5, 1.5)

    @task
    def burst(self) -> None:
        if not self.sessions():
            self._discover_sessions()
            if not self.sessions():
                self._make_session()
            if not self.sessions():
                return
        session_id = random.choice(self.sessions())
        for _ in range(BURST_READS):
            with self.client.get(f"{API}/sessions/{session_id}/", name=f"{API}/sessions/[id]/ (burst)",
                                 catch_response=True) as response:
                if response.status_code != 200:
                    response.failure(describe(response))
                    return

    def _discover_sessions(self) -> None:
        with self.client.get(f"{API}/sessions/?page_size=50", name=f"{API}/sessions/",
                             catch_response=True) as response:
            if response.status_code != 200:
                response.failure(describe(response))
                return
            self.sessions().extend(str(row["id"]) for row in response.json()["results"])

    def _make_session(self) -> None:
        request = {"prompt": random.choice(PROMPTS), "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0}
        with self.client.post(f"{API}/generations/", json=request, name=f"{API}/generations/",
                              catch_response=True) as response:
            if response.status_code not in (200, 202):
                response.failure(describe(response))
                return
            self.remember(str(response.json()["id"]))
