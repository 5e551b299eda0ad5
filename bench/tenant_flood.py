"""Phase 1 of bench/abuse.py: a quiet tenant's first tokens, alone and while a noisy tenant floods.

The quiet tenant's clients run in the bench's process, the noisy tenant's in a process of its own
(``noisy_process``); afterwards the sessions' stats in the bench database split each first token
(``worker_times_ms``, ``queue_waits_ms``, ``slowest``) and give the noisy tenant's share of the
tokens (``noisy_share``).
"""
from __future__ import annotations

import asyncio
import collections
import gc
import multiprocessing as mp
import time

from bench.common import percentile

PROBE_PATH = "/api/v1/models/"  # the probe of bench/abuse.py, and what ``settle`` asks until it is quick again


POST_MS: dict[str, float] = {}  # each quiet session's POST, to its 202
STREAM_OPEN_MS: dict[str, float] = {}  # ... and to its stream's response headers


async def first_token_ms(client, model: str, max_tokens: int, number: int, statuses) -> tuple[float | None, str]:
    """POST a generation and read its stream to the end; (ms from the POST to the first tokens
    event, the session's id)."""
    started = time.perf_counter()
    body = {"prompt": f"def quiet_{number}(x):\n    ", "model": model, "max_new_tokens": max_tokens,
            "temperature": 0.8}  # sampled: the prediction cache does not answer it
    response = await client.post("/api/v1/generations/", json=body)
    statuses[response.status_code] += 1
    if response.status_code != 202:
        return None, ""
    first, session_id = None, response.json()["id"]
    POST_MS[session_id] = (time.perf_counter() - started) * 1000
    async with client.stream("GET", f"/api/v1/sessions/{session_id}/stream/") as stream:
        statuses[stream.status_code] += 1
        STREAM_OPEN_MS[session_id] = (time.perf_counter() - started) * 1000
        async for line in stream.aiter_lines():
            if line.startswith("event: tokens") and first is None:
                first = (time.perf_counter() - started) * 1000
            elif line.startswith("event:") and "tokens" not in line:
                break
    return first, session_id


async def quiet_tenant(args, client, model: str, statuses, phase: int) -> tuple[list[float], list[str]]:
    """Each quiet client's generations, one every ``--quiet-interval-s``: (TTFTs in ms, session ids)."""
    async def one_client(number: int) -> list[tuple[float, str]]:
        measured = []
        for request in range(args.quiet_requests):
            began = time.perf_counter()
            try:
                ms, session_id = await first_token_ms(client, model, args.quiet_tokens,
                                                      phase * 100_000 + number * 1000 + request, statuses)
            except httpx_error() as exc:
                statuses[f"{type(exc).__name__} (quiet POST or stream)"] += 1
                ms = None
            if ms is not None:
                measured.append((ms, session_id))
            await asyncio.sleep(max(0.0, args.quiet_interval_s - (time.perf_counter() - began)))
        return measured

    pairs = [pair for measured in await asyncio.gather(*(one_client(n) for n in range(args.quiet_clients)))
             for pair in measured]
    return [ms for ms, _ in pairs], [session_id for _, session_id in pairs]


def httpx_error():
    import httpx2

    return httpx2.HTTPError


async def noisy_tenant(args, client, model: str, statuses, stop) -> int:
    """Submit generations at ``--noisy-factor`` times the quiet tenant's rate until ``stop`` is set."""
    rate = args.noisy_factor * args.quiet_clients / args.quiet_interval_s
    submitted, pending = 0, set()

    async def submit(number: int) -> None:
        body = {"prompt": f"class Noisy{number}:\n    ", "model": model, "max_new_tokens": args.noisy_tokens,
                "temperature": 0.8}
        try:
            statuses[(await client.post("/api/v1/generations/", json=body)).status_code] += 1
        except httpx_error() as exc:
            statuses[f"{type(exc).__name__} (noisy POST)"] += 1

    started = time.perf_counter()
    while not stop.is_set():
        task = asyncio.create_task(submit(submitted))
        pending.add(task)
        task.add_done_callback(pending.discard)
        submitted += 1
        await asyncio.sleep(max(0.0, started + submitted / rate - time.perf_counter()))
    await asyncio.gather(*pending)
    return submitted


def noisy_process(args, base_url: str, token: str, model: str, ready, stop, results) -> None:
    """The noisy tenant as a client of its own (another process): its requests' CPU and its loop
    are not the quiet client's, as two tenants' clients are not on one machine."""
    gc.freeze()  # as the quiet client's process does (settle)

    async def flood() -> tuple[int, dict]:
        statuses: collections.Counter = collections.Counter()
        async with tenant_client(base_url, token) as client:
            ready.set()  # imported and connected: the lead and the quiet tenant's timing start now
            submitted = await noisy_tenant(args, client, model, statuses, stop)
        return submitted, dict(statuses)

    results.put(asyncio.run(flood()))


def tenant_client(base_url: str, token: str):
    import httpx2

    return httpx2.AsyncClient(base_url=base_url, headers={"Authorization": f"Token {token}"},
                              timeout=httpx2.Timeout(60, read=120),
                              # idle connections dropped before the server's keep-alive (gunicorn's 2 s)
                              # closes them: a reuse racing that close is a reset of the client's own
                              limits=httpx2.Limits(max_connections=200, max_keepalive_connections=200,
                                                   keepalive_expiry=1.0))


async def settle(base_url: str, token: str, baseline_p95_ms: float, log) -> None:
    """Wait (at most 15 s) until five GET {PROBE_PATH} in a row answer within twice the probe's
    p95 alone: the web process is warm and idle before the quiet tenant is timed alone."""
    gc.collect()  # this process's garbage from the phase before, not during a measurement,
    gc.freeze()  # and its modules (Django, torch) out of its full collections: a 250 ms pause here is the client's
    started, in_a_row = time.perf_counter(), 0
    async with tenant_client(base_url, token) as client:
        while in_a_row < 5 and time.perf_counter() - started < 15:
            began = time.perf_counter()
            await client.get(PROBE_PATH)
            in_a_row = in_a_row + 1 if (time.perf_counter() - began) * 1000 <= 2 * baseline_p95_ms else 0
            await asyncio.sleep(0.1)
    log(f"settled in {time.perf_counter() - started:.1f} s")


async def tenants(args, base_url: str, tokens: dict, model: str, statuses, baseline_p95_ms: float, log) -> dict:
    await settle(base_url, tokens["quiet"], baseline_p95_ms, log)
    async with tenant_client(base_url, tokens["quiet"]) as quiet:
        warm, _ = await first_token_ms(quiet, model, args.quiet_tokens, -1, statuses)  # the worker loads the pair
        log(f"warm-up generation: first token {warm or float('nan'):.0f} ms")
        alone, alone_ids = await quiet_tenant(args, quiet, model, statuses, 1)
        log(f"quiet alone: {len(alone)} generations, TTFT p50 {percentile(alone, 0.5):.0f} ms, "
            f"p95 {percentile(alone, 0.95):.0f} ms")
        ctx = mp.get_context("spawn")
        ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
        flood = ctx.Process(target=noisy_process, args=(args, base_url, tokens["noisy"], model, ready, stop, results))
        flood.start()
        await asyncio.to_thread(ready.wait, 120)  # its imports (seconds of CPU) are not part of the flood
        await asyncio.sleep(args.noisy_lead_s)  # the noisy tenant's backlog builds up first
        flood_started = time.time()
        loaded, loaded_ids = await quiet_tenant(args, quiet, model, statuses, 2)
        flood_ended = time.time()
        stop.set()
        submitted, noisy_statuses = await asyncio.to_thread(results.get, timeout=180)
        flood.join()
        statuses.update(noisy_statuses)
        log(f"quiet while the noisy tenant floods ({submitted} submitted): {len(loaded)} generations, "
            f"TTFT p50 {percentile(loaded, 0.5):.0f} ms, p95 {percentile(loaded, 0.95):.0f} ms")
    return {"alone": alone, "loaded": loaded, "alone_ids": alone_ids, "loaded_ids": loaded_ids,
            "window": (flood_started, flood_ended)}


def drain_noisy(log, timeout_s: float = 120) -> None:
    """Wait until the noisy tenant has no queued or running session left."""
    from metadata.models import Session
    from metadata.models.sessions import LIVE_STATUSES

    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s and Session.objects.filter(
            tenant__name="bench-noisy", status__in=LIVE_STATUSES).exists():
        time.sleep(0.5)
    log(f"the noisy tenant's backlog drained in {time.perf_counter() - started:.1f} s")


def noisy_share(window: tuple[float, float]) -> float:
    """The noisy tenant's share of the tokens of the sessions that ended in the window."""
    from datetime import UTC, datetime

    from django.db.models import Sum

    from metadata.models import Session

    began, ended = (datetime.fromtimestamp(t, UTC) for t in window)
    made = {row["tenant__name"]: row["tokens"] or 0 for row in Session.objects.filter(
        finished_at__gte=began, finished_at__lte=ended, tenant__name__in=("bench-quiet", "bench-noisy"))
        .values("tenant__name").annotate(tokens=Sum("token_count"))}
    total = sum(made.values())
    return made.get("bench-noisy", 0) / total if total else float("nan")


def preemptions(window: tuple[float, float]) -> dict[str, int]:
    """Preemptions of each tenant's sessions that ended in the window (their stats)."""
    from datetime import UTC, datetime

    from metadata.models import Session

    began, ended = (datetime.fromtimestamp(t, UTC) for t in window)
    counts: collections.Counter = collections.Counter()
    for tenant, stats in Session.objects.filter(
            finished_at__gte=began, finished_at__lte=ended, tenant__name__in=("bench-quiet", "bench-noisy")
    ).values_list("tenant__name", "stats"):
        counts[tenant.removeprefix("bench-")] += int((stats or {}).get("preemptions") or 0)
    return dict(counts)


def worker_times_ms(session_ids: list[str]) -> dict[str, list[float]]:
    """The worker's view of each session (its stats): from the row's creation to its batch
    admission (``queue``) and to its first step's tokens (``ttft``), and the rows beside it."""
    from metadata.models import Session

    times: dict[str, list[float]] = {"queue": [], "ttft": [], "rows": []}
    for stats in Session.objects.filter(pk__in=session_ids).values_list("stats", flat=True):
        stats = stats or {}
        for key, name in (("queue", "queue_seconds"), ("ttft", "ttft_seconds")):
            if stats.get(name) is not None:
                times[key].append(stats[name] * 1000)
        if stats.get("batch_rows_max") is not None:
            times["rows"].append(stats["batch_rows_max"])
    return times


def queue_waits_ms(session_ids: list[str]) -> list[float]:
    """Each session's wait from its row's creation to its worker's claim (a free batch slot)."""
    from metadata.models import Session

    return [(started - created).total_seconds() * 1000 for created, started in Session.objects.filter(
        pk__in=session_ids, started_at__isnull=False).values_list("created_at", "started_at")]


def slowest(ttfts: list[float], session_ids: list[str], count: int = 3) -> list[str]:
    """The ``count`` slowest first tokens, each split: POST, stream headers (client, from the
    POST's start), claimed, in the batch, first tokens in the worker (from the row's creation)."""
    from metadata.models import Session

    rows = {str(pk): (created, started, stats or {}) for pk, created, started, stats in Session.objects.filter(
        pk__in=session_ids).values_list("pk", "created_at", "started_at", "stats")}
    lines = []
    for ms, session_id in sorted(zip(ttfts, session_ids), reverse=True)[:count]:
        created, started, stats = rows.get(session_id, (None, None, {}))
        claimed = (started - created).total_seconds() * 1000 if created and started else float("nan")
        batch, first = ((stats.get(k) or float("nan")) * 1000 for k in ("queue_seconds", "ttft_seconds"))
        lines.append(f"{ms:.0f} ms = POST {POST_MS.get(session_id, float('nan')):.0f}, headers "
                     f"{STREAM_OPEN_MS.get(session_id, float('nan')):.0f} | claimed {claimed:.0f}, in the batch "
                     f"{batch:.0f}, first tokens {first:.0f}")
    return lines
