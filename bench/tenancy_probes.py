"""The probes of bench/tenancy.py: tenant A against tenant B, over HTTP and Redis only.

Each probe returns its figure and counts the server's answers in ``statuses`` (a 5xx, or a failed
connection, is a server error). The bench prepares what a probe needs beforehand (tenants, tokens,
sessions no worker runs, a staff member of tenant A) and passes it in ``Setup``.
"""
from __future__ import annotations

import asyncio
import collections
import re
import select
import socket
import time
import uuid
from dataclasses import dataclass, field

import httpx2

FORGED_LSN = "FFFFFFFF/FFFFFFFF"
BAD_EVENT_ID = "99999999999999999999-0"  # 20 digits: past what Redis accepts as a stream id
PREAUTH_BYTES = 65_536
B_PROMPT = "tenant B idle prompt"  # what B's idle sessions hold: shown to A's staff is a leak
SECRET = ("# the secret plan: merge with the competitor on friday, tell nobody\n"
          + "def plan(a, b):\n    return a + b\n\n" * 4)


@dataclass
class Setup:
    """What the probes are given: the server, each tenant's token, sessions no worker runs."""

    base_url: str
    port: int
    model: str
    tokens: dict[str, str]  # "a", "b"
    idle: dict[str, str]  # idle sessions by use: "b_followed", "a_own", "b_lsn", "a_lsn"
    staff: tuple[str, str]  # tenant A's staff member: (username, password)
    race_sessions: list[str] = field(default_factory=list)  # idle, never read: B's and A's in turn
    statuses: collections.Counter = field(default_factory=collections.Counter)

    def client(self, tenant: str | None, **kwargs) -> httpx2.Client:
        headers = {"Authorization": f"Token {self.tokens[tenant]}"} if tenant else {}
        return httpx2.Client(base_url=self.base_url, headers=headers, timeout=httpx2.Timeout(120), **kwargs)

    def count(self, response: httpx2.Response) -> httpx2.Response:
        self.statuses[response.status_code] += 1
        return response


# ---------------------------------------------------------------------------- the prefix cache
def cached_tokens(setup: Setup, tenant: str, prompt: str, max_tokens: int) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a finished greedy completion (each call its
    own ``max_tokens``, so the prediction cache never answers)."""
    with setup.client(tenant) as client:
        response = setup.count(client.post("/v1/completions", json={
            "model": setup.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}))
    if response.status_code != 200:
        raise SystemExit(f"error: a completion of tenant {tenant} answered {response.status_code}: "
                         f"{response.text[:300]}")
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def prefix_oracle(setup: Setup, common_blocks, log) -> int:
    """B sends a secret; A sends it with a word changed, then the secret itself: how many of A's
    probes adopted B's blocks. The first shares only B's prefix; the second also shares A's own
    first probe up to the changed word (``common_blocks(one, other)``: whole 16-token blocks in
    common), which A may adopt; only what goes past that is B's."""
    secret = f"# {uuid.uuid4().hex}\n{SECRET}"
    changed = secret.replace("friday", "monday")
    cached_tokens(setup, "b", secret, 4)
    own = cached_tokens(setup, "b", secret, 5)
    first = cached_tokens(setup, "a", changed, 6)
    second = cached_tokens(setup, "a", secret, 7)
    own_prefix = common_blocks(secret, changed)
    log(f"prefix cache: B's own repeat adopted {own} tokens (the cache works within a tenant); A's probes were "
        f"told cached_tokens={first} (one word changed) and {second} (the same text; {own_prefix} of its tokens "
        "are A's own first probe's blocks)")
    return int(first > 0) + int(second > own_prefix)


# ---------------------------------------------------------------------------- streams
async def follow_until_end(client: httpx2.AsyncClient, path: str, headers: dict, statuses) -> str:
    """Read a stream until its first event other than tokens; that event's name (or how it ended)."""
    try:
        async with client.stream("GET", path, headers=headers) as response:
            statuses[response.status_code] += 1
            if response.status_code != 200:
                return f"HTTP {response.status_code}"
            async for line in response.aiter_lines():
                if line.startswith("event:") and "tokens" not in line:
                    return line.split(":", 1)[1].strip()
            return "closed"
    except httpx2.HTTPError as exc:
        statuses[type(exc).__name__] += 1
        return type(exc).__name__


async def other_tenants_bad_followers(setup: Setup, publish_done, log) -> int:
    """B follows its session; A opens 30 streams of its own with a Last-Event-ID Redis refuses;
    then B's session ends. 1 when B's stream ended before its ``done``."""
    limits = httpx2.Limits(max_connections=64)
    async with httpx2.AsyncClient(base_url=setup.base_url, timeout=httpx2.Timeout(60, read=120),
                                  limits=limits) as client:
        b_headers = {"Authorization": f"Token {setup.tokens['b']}"}
        followed = asyncio.create_task(follow_until_end(
            client, f"/api/v1/sessions/{setup.idle['b_followed']}/stream/", b_headers, setup.statuses))
        await asyncio.sleep(1.0)  # B's stream is open and waiting
        a_headers = {"Authorization": f"Token {setup.tokens['a']}", "Last-Event-ID": BAD_EVENT_ID}
        bad = await asyncio.gather(*(follow_until_end(
            client, f"/api/v1/sessions/{setup.idle['a_own']}/stream/", a_headers, setup.statuses)
            for _ in range(30)))
        await asyncio.sleep(2.0)
        ended_early = followed.done()
        await asyncio.to_thread(publish_done, setup.idle["b_followed"])
        outcome = await asyncio.wait_for(followed, 30)
    log(f"streams: A's 30 followers with Last-Event-ID {BAD_EVENT_ID} got {dict(collections.Counter(bad))}; "
        f"B's stream {'ended before' if ended_early else 'stayed open until'} its session ended, with {outcome!r}")
    return int(ended_early or outcome != "done")


# ---------------------------------------------------------------------------- pre-auth bodies
def answered(sock: socket.socket, timeout: float) -> bool:
    return bool(select.select([sock], [], [], timeout)[0])


def status_of(sock: socket.socket) -> int:
    sock.setblocking(True)
    sock.settimeout(10)
    try:
        head = sock.recv(4096)
    except OSError:
        return 0
    match = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    return int(match.group(1)) if match else 0


SENT_CAP = 8 * 1024 * 1024  # past this the server is plainly reading the body: stop sending


def body_sent_before_answer(port: int, path: str, headers: dict[str, str], declared: int | None) -> tuple[int, int]:
    """POST a body of ``declared`` bytes (None: chunked, endless), stopping when the server
    answers; (body bytes sent before the answer, its status; at most ``SENT_CAP`` are sent).
    Around the bound the client is slow (a KiB at a time, waiting for an answer after each), so
    bytes in flight when the server answers do not count; past it, it sends fast."""
    sock = socket.create_connection(("127.0.0.1", port))
    framing = f"Content-Length: {declared}\r\n" if declared is not None else "Transfer-Encoding: chunked\r\n"
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{framing}"
            + "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n")
    sent = 0
    try:
        sock.sendall(head.encode())
        if answered(sock, 1.0):  # refused on its headers: nothing of the body was wanted
            return 0, status_of(sock)
        limit = min(SENT_CAP, declared if declared is not None else SENT_CAP)
        while sent < limit:
            near_bound = sent < PREAUTH_BYTES + 8 * 1024
            piece = b"x" * min(limit - sent, 1024 if near_bound else 256 * 1024)
            sock.sendall(piece if declared is not None else f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sent += len(piece)
            if answered(sock, 0.2 if PREAUTH_BYTES - 4096 <= sent and near_bound else 0.0005):
                return sent, status_of(sock)
        return sent, 0  # no answer yet: it reads on
    except OSError:  # the server closed the connection: what was sent by then is what it got
        return sent, status_of(sock)
    finally:
        sock.close()


def preauth_bodies(setup: Setup, log) -> int:
    """Bodies without valid credentials: the most any of them got through before the answer."""
    cases = [
        ("multipart 300 MB to /api/v1/sessions/", "/api/v1/sessions/",
         {"Content-Type": "multipart/form-data; boundary=xyz"}, 314_614_676),
        ("JSON 300 MB to /api/v1/generations/", "/api/v1/generations/", {"Content-Type": "application/json"},
         300_000_000),
        ("JSON 1 MB with a made-up token", "/api/v1/generations/",
         {"Content-Type": "application/json", "Authorization": "Token " + "f" * 40}, 1_000_000),
        ("chunked JSON to /v1/chat/completions", "/v1/chat/completions", {"Content-Type": "application/json"}, None),
        ("chunked form to /admin/login/", "/admin/login/", {"Content-Type": "application/x-www-form-urlencoded"},
         None),
    ]
    most = 0
    for label, path, headers, declared in cases:
        sent, status = body_sent_before_answer(setup.port, path, headers, declared)
        if status:
            setup.statuses[status] += 1
            log(f"pre-auth body, {label}: {sent} bytes sent before the answer ({status})")
        else:
            log(f"pre-auth body, {label}: {sent} bytes sent and no answer yet: the server reads on")
        most = max(most, sent)
    return most


# ---------------------------------------------------------------------------- forged LSN
async def forged_race(setup: Setup, client: httpx2.AsyncClient, owner: str, session: str, offset_s: float) -> bool:
    """A reads a session never read before with a forged floor (a cache miss: it loads) while its
    owner cancels it; True when a read after both still shows it queued (the stale load won)."""
    path = f"/api/v1/sessions/{session}/"
    forged = {"Authorization": f"Token {setup.tokens['a']}", "X-SpecOps-LSN": FORGED_LSN}
    own = {"Authorization": f"Token {setup.tokens[owner]}"}

    async def cancel() -> None:
        await asyncio.sleep(offset_s)
        setup.statuses[(await client.post(f"{path}cancel/", headers=own)).status_code] += 1

    answers = await asyncio.gather(*(client.get(path, headers=forged) for _ in range(6)), cancel())
    for answer in answers[:6]:
        setup.statuses[answer.status_code] += 1
    await asyncio.sleep(0.3)
    stale = False
    for _ in range(3):
        after = await client.get(path, headers=own)
        setup.statuses[after.status_code] += 1
        stale = stale or after.json().get("status") != "cancelled"
        await asyncio.sleep(0.1)
    return stale


async def forged_lsn(setup: Setup, log) -> int:
    """A's reads with ``X-SpecOps-LSN: FFFFFFFF/FFFFFFFF`` racing the owner's cancel, on B's sessions
    and on A's own: how many sessions still read as queued after the cancel."""
    effects = collections.Counter()
    async with httpx2.AsyncClient(base_url=setup.base_url, timeout=httpx2.Timeout(60)) as client:
        for number, session in enumerate(setup.race_sessions):
            owner = "b" if number % 2 == 0 else "a"
            effects[owner] += await forged_race(setup, client, owner, session, (number // 2 % 10) * 0.002)
    log(f"forged LSN: {len(setup.race_sessions)} sessions read with a forged floor while their owner cancelled "
        f"them; still queued afterwards: {effects['b']} of B's, {effects['a']} of A's own")
    return sum(effects.values())


# ---------------------------------------------------------------------------- Redis
def redis_credentials(setup: Setup, redis_url: str, secrets_: list[str], log) -> int:
    """Keys of the Redis database whose name or value holds an API token or a password hash (each
    tenant makes a request first: its token's cache entry is fresh)."""
    import redis

    for tenant in ("a", "b"):
        with setup.client(tenant) as client:
            setup.count(client.get("/api/v1/models/"))

    client = redis.Redis.from_url(redis_url)
    needles = [secret.encode() for secret in secrets_] + [b"pbkdf2_sha256$", b"argon2$", b"bcrypt"]
    found, pickled, scanned = 0, 0, 0
    for key in client.scan_iter(count=1000):
        scanned += 1
        value = client.get(key) if client.type(key) == b"string" else b""
        if any(needle in key or needle in (value or b"") for needle in needles):
            found += 1
        if value and value[:1] == b"\x80":  # a pickle's protocol opcode
            pickled += 1
    log(f"Redis: {scanned} keys scanned, {found} hold a token or a password hash, {pickled} values are pickles")
    return found


# ---------------------------------------------------------------------------- the web edge and the admin
def web_edge(setup: Setup, request_log_rows, log) -> dict:
    """Part B's probes: a deep form body, anonymous 404s, an idempotent retry, the admin's tenant
    boundary, a bad cursor and its sign-in throttle. Their findings, for the printed lines."""
    findings = {}
    with setup.client("a") as a:
        deep = setup.count(a.post("/api/v1/generations/", data={"prompt": "x", "response_format": "[" * 50_000}))
        findings["deep_form"] = deep.status_code
        body = {"prompt": "import os\n", "model": setup.model, "max_new_tokens": 2}
        first = setup.count(a.post("/api/v1/generations/", json=body, headers={"Idempotency-Key": "retry-1"}))
        again = setup.count(a.post("/api/v1/generations/", json=body, headers={"Idempotency-Key": "retry-1"}))
        findings["idempotent"] = first.json().get("id") == again.json().get("id") is not None
    time.sleep(1.5)  # the rows of the requests above are flushed (every 0.5 s) before the count
    rows_before = request_log_rows()
    with setup.client(None) as anonymous:
        for number in range(200):
            setup.count(anonymous.get(f"/api/v1/nothing-{number}/"))
    time.sleep(1.5)  # the request log's writer flushes every 0.5 s
    findings["anonymous_rows"] = request_log_rows() - rows_before
    with setup.client(None, follow_redirects=False) as admin:
        admin.get("/admin/login/")
        username, password = setup.staff
        login = setup.count(admin.post("/admin/login/", data={
            "username": username, "password": password, "csrfmiddlewaretoken": admin.cookies.get("csrftoken", ""),
            "next": "/admin/"}, headers={"Referer": f"{setup.base_url}/admin/login/"}))
        findings["staff_login"] = login.status_code
        page = f"/admin/metadata/session/{setup.idle['a_own']}/change/?steps=WyJ4Il0"
        own = admin.get(page)
        findings["relogin_lag"] = own.status_code == 302 and "/admin/login/" in own.headers.get("location", "")
        if findings["relogin_lag"]:  # the sign-in's session row read from a replica that had not replayed it
            time.sleep(1.0)
            own = admin.get(page)
        setup.count(own)
        other = setup.count(admin.get(f"/admin/metadata/session/{setup.idle['b_followed']}/change/",
                                      follow_redirects=True))
        findings["bad_cursor"] = own.status_code
        findings["admin_sees_other_tenant"] = B_PROMPT in other.text
    with setup.client(None) as guesser:
        guesser.get("/admin/login/")
        form = {"username": username, "csrfmiddlewaretoken": guesser.cookies.get("csrftoken", "")}
        guesses = [guesser.post("/admin/login/", data={**form, "password": f"guess{n}"},
                                headers={"Referer": f"{setup.base_url}/admin/login/"}).status_code for n in range(15)]
    findings["login_refused"] = guesses.count(429)
    findings["login_answers"] = dict(collections.Counter(guesses))
    log(f"web edge: form response_format 50,000 [ deep: {findings['deep_form']}; an Idempotency-Key retry "
        f"{'answered with the first session' if findings['idempotent'] else 'made a second session'}; 200 "
        f"anonymous 404s wrote {findings['anonymous_rows']} request-log rows")
    log(f"admin: staff of A signed in ({findings['staff_login']}), its session page with ?steps=WyJ4Il0: "
        f"{findings['bad_cursor']}{' (asked again after 1 s: its sign-in was not on the replica yet)' if findings['relogin_lag'] else ''}, "
        f"B's session page shown to it: {findings['admin_sees_other_tenant']}; "
        f"15 wrong passwords: {findings['login_refused']} refused with 429 (answers {findings['login_answers']})")
    return findings
