"""Hostile load on one web process and one worker: thousands of open streams, a noisy tenant.

Starts its own services on a database of its own (``specops_bench_abuse``, dropped at the end
unless ``--keep``) and a Redis database of its own (``--redis-db``, flushed first): one web
process (gunicorn with one uvicorn worker, as ``scripts/run.sh`` runs it) and one batching Celery
worker with a tiny random model pair (built in seconds under ``var/bench-models``). The throttles
are off (one client makes every request); the tenant quotas and the fair admission are on: the
broker's priorities, and the batching engine's fair admission and preemption across tenants, for
which the worker claims ``--claims`` sessions (task threads) for its ``--max-batch`` rows
(``--no-fair``: the engine's first in, first out, and as many claims as rows, as before).

1. **Noisy tenant.** ``--quiet-clients`` clients of a quiet tenant each make ``--quiet-requests``
   generations, one every ``--quiet-interval-s``, and time each one's first token (``POST
   /api/v1/generations/`` to the first ``tokens`` event of its stream): alone, then while a noisy
   tenant submits ``--noisy-factor`` times the quiet tenant's rate of generations
   (``--noisy-tokens`` each; past its quota it gets 429s and keeps flooding). The noisy tenant is
   a client process of its own (two tenants' clients do not share an event loop); both client
   processes freeze their startup objects out of garbage collection (a 250 ms full collection
   of the client's own was measured as the server's time before).

2. **Streams.** ``GET /api/v1/models/`` is timed every 20 ms for ``--probe-s`` seconds alone
   (the baseline), then ``--streams`` session streams are opened (``GET
   /api/v1/sessions/{id}/stream/`` on queued sessions of a tenant of their own, which no worker
   runs) and the same probe runs while they are all open; the Redis connections the web process
   holds for them are counted (``CLIENT LIST``). Then a ``done`` is published on every stream (as
   a worker ends a session) and each stream must end with it.
   Phase 2 starts once the noisy backlog has drained (it must not fall into the streams' probe);
   it runs second because 2,000 streams closing leave the web process hundreds of thousands of
   objects to collect, which must not fall into the quiet tenant's time alone.

A server error is any 5xx or failed connection, in every phase.

    .venv/bin/python bench/abuse.py [--streams 2000] [--probe-s 10]

Last line: ``RESULT streams_open=<n> other_p95_ms=<x> quiet_ttft_loaded_over_alone=<x>
noisy_share=<x> server_errors=<n>`` (``other_p95_ms``: the probe's p95 while the streams were
open; the quiet tenant's TTFT p95 while the noisy one floods, over its TTFT p95 alone; the noisy
tenant's share of the tokens of the sessions that ended while it flooded).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing as mp
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    ADMIN_URL,
    NO_THROTTLES,
    database_url,
    drop_database,
    free_port,
    percentile,
    recreate_database,
    register_tiny_pair,
    say,
    stop_process_group,
)
from bench.streams import start, wait_http  # noqa: E402
from bench.tenant_flood import (  # noqa: E402
    POST_MS,
    PROBE_PATH,
    STREAM_OPEN_MS,
    drain_noisy,
    noisy_share,
    preemptions,
    queue_waits_ms,
    slowest,
    tenants,
    worker_times_ms,
)

BENCH_DB = "specops_bench_abuse"
TENANTS = ("streams", "quiet", "noisy")


def bench_environment(args) -> dict[str, str]:
    """The environment of this process and of the services it starts."""
    env = {
        "DATABASE_URL": database_url(args.admin_url, BENCH_DB), "DATABASE_REPLICA_URLS": "",
        "REDIS_URL": f"redis://127.0.0.1:6379/{args.redis_db}",
        "SPECOPS_MODEL_DIR": str(ROOT / "var" / "bench-models"), "HF_HUB_OFFLINE": "1",
        "DJANGO_SETTINGS_MODULE": "specops.settings", "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
        "SECRET_KEY": os.environ.get("SECRET_KEY") or secrets.token_urlsafe(40),
        **NO_THROTTLES,  # one client makes every request; the tenant quotas stay on
        "SPECOPS_MAX_BATCH": str(args.max_batch),
        "SPECOPS_FAIR_ADMISSION": "false" if args.no_fair else "true",
        "SPECOPS_PREEMPTION": "false" if args.no_fair else "true",
        "OMP_NUM_THREADS": "1",  # as scripts/run.sh starts workers
    }
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):  # both are REDIS_URL's database
        os.environ.pop(name, None)
    os.environ.update(env)
    return env


def prepare(args) -> tuple[dict[str, str], str, list[str]]:
    """Migrate, register the tiny pair, make the tenants and their tokens, and the queued sessions
    the streams follow; return (token per tenant, model name, those sessions' ids)."""
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connections
    from rest_framework.authtoken.models import Token

    from metadata.models import ModelVersion
    from metadata.models import Session, Tenant, TenantMembership
    from sessions.streams import token_stream

    token_stream.client().flushdb()
    call_command("migrate", verbosity=0)
    model = register_tiny_pair()
    tokens = {}
    for name in TENANTS:
        tenant = Tenant.objects.create(name=f"bench-{name}")
        if name == "streams":  # its own limit, above the streams this bench opens
            tenant.max_open_streams = args.streams + 100
            tenant.save(update_fields=["max_open_streams"])
        user = get_user_model().objects.create_user(f"bench-{name}", password=secrets.token_urlsafe(12))
        TenantMembership.objects.create(user=user, tenant=tenant)
        tokens[name] = Token.objects.create(user=user).key
    target = ModelVersion.objects.get(name=model, role="target", status="active")
    streams_tenant = Tenant.objects.get(name="bench-streams")
    # Queued sessions that no task was sent for: their streams stay open, heartbeating, until told.
    sessions = Session.objects.bulk_create(
        Session(tenant=streams_tenant, target=target, drafter="ngram", queue="unserved", prompt="x", prompt_tokens=1)
        for _ in range(args.streams))
    connections.close_all()
    return tokens, model, [str(s.pk) for s in sessions]


def probe(base_url: str, token: str, seconds: float, interval_s: float, results) -> None:
    """Time GET /api/v1/models/ for ``seconds`` (another process: the client's loop is busy)."""
    import httpx2

    latencies, statuses = [], collections.Counter()
    deadline = time.monotonic() + seconds
    with httpx2.Client(base_url=base_url, headers={"Authorization": f"Token {token}"}, timeout=30) as client:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                statuses[client.get(PROBE_PATH).status_code] += 1
            except httpx2.HTTPError as exc:
                statuses[type(exc).__name__] += 1
            latencies.append((time.perf_counter() - started) * 1000)
            time.sleep(max(0.0, interval_s - (time.perf_counter() - started)))
    results.put((latencies, dict(statuses)))


def run_probe(args, base_url: str, token: str, statuses: collections.Counter) -> list[float]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=probe, args=(base_url, token, args.probe_s, args.probe_interval_s, results))
    process.start()
    latencies, probe_statuses = results.get(timeout=args.probe_s + 120)
    process.join()
    statuses.update(probe_statuses)
    return latencies


def stream_connections(redis_db: int) -> int:
    """Connections of the web process's stream pool (``specops-streams-<pid>``) in our database."""
    import redis
    from django.conf import settings

    return sum(1 for c in redis.Redis.from_url(settings.REDIS_URL).client_list()
               if c.get("name", "").startswith("specops-streams-") and int(c.get("db", -1)) == redis_db)


class Streams:
    """The open streams: how many answered 200 and are open, how many ended with ``done``."""

    def __init__(self) -> None:
        self.open = self.peak = self.done = 0
        self.errors: list[str] = []

    async def follow(self, client, session_id: str, statuses: collections.Counter) -> None:
        counted = False
        try:
            async with client.stream("GET", f"/api/v1/sessions/{session_id}/stream/") as response:
                statuses[response.status_code] += 1
                if response.status_code != 200:
                    self.errors.append(f"HTTP {response.status_code}")
                    return
                self.open += 1
                self.peak = max(self.peak, self.open)
                counted = True
                async for line in response.aiter_lines():
                    if line.startswith("event: done"):
                        self.done += 1
                        return
                    if line.startswith("event:") and "tokens" not in line:
                        self.errors.append(line)
                        return
        except Exception as exc:  # noqa: BLE001 (every failure of a stream is counted)
            statuses[type(exc).__name__] += 1
            self.errors.append(f"{type(exc).__name__}: {exc}"[:160])
        finally:
            if counted:
                self.open -= 1


async def open_streams(args, base_url: str, tokens: dict, sessions: list[str], statuses, log) -> dict:
    """Open a stream on every session, probe while they are open, then end them all."""
    import httpx2

    from sessions.streams import token_stream

    limits = httpx2.Limits(max_connections=len(sessions) + 50, max_keepalive_connections=len(sessions) + 50)
    streams = Streams()
    async with httpx2.AsyncClient(base_url=base_url, headers={"Authorization": f"Token {tokens['streams']}"},
                                  timeout=httpx2.Timeout(60, read=120), limits=limits) as client:
        started = time.perf_counter()
        tasks = [asyncio.create_task(streams.follow(client, s, statuses)) for s in sessions]
        while streams.open + len(streams.errors) < len(sessions) and time.perf_counter() - started < 300:
            await asyncio.sleep(0.1)
        log(f"{streams.open} streams open ({len(streams.errors)} failed) in {time.perf_counter() - started:.1f} s")
        connections = stream_connections(args.redis_db)
        loaded = await asyncio.to_thread(run_probe, args, base_url, tokens["quiet"], statuses)
        connections = max(connections, stream_connections(args.redis_db))
        open_at_end = streams.open
        ended = time.perf_counter()
        for first in range(0, len(sessions), 500):  # as workers end sessions: one done each
            token_stream.publish_many([token_stream.StreamEvent(s, "done", {
                "status": "cancelled", "finish_reason": "cancelled", "error": ""}) for s in sessions[first:first + 500]])
        async with asyncio.timeout(120):
            await asyncio.gather(*tasks)
        log(f"{streams.done} streams ended with their done {time.perf_counter() - ended:.1f} s after it was published")
    return {"streams": streams, "loaded": loaded, "connections": connections, "open_at_end": open_at_end}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--probe-s", type=float, default=10.0)
    parser.add_argument("--probe-interval-s", type=float, default=0.02)
    parser.add_argument("--max-batch", type=int, default=8, help="SPECOPS_MAX_BATCH of the worker")
    parser.add_argument("--claims", type=int, default=0,
                        help="the worker's task threads, sessions it holds at once (default: twice --max-batch)")
    parser.add_argument("--no-fair", action="store_true",
                        help="SPECOPS_FAIR_ADMISSION and SPECOPS_PREEMPTION off, and claims = rows (the baseline)")
    parser.add_argument("--quiet-clients", type=int, default=2)
    parser.add_argument("--quiet-requests", type=int, default=25, help="generations per quiet client and phase")
    parser.add_argument("--quiet-interval-s", type=float, default=1.0)
    parser.add_argument("--quiet-tokens", type=int, default=16)
    parser.add_argument("--noisy-factor", type=float, default=10.0)
    parser.add_argument("--noisy-tokens", type=int, default=16)
    parser.add_argument("--noisy-lead-s", type=float, default=3.0)
    parser.add_argument("--admin-url", default=ADMIN_URL)
    parser.add_argument("--redis-db", type=int, default=10)
    parser.add_argument("--keep", action="store_true", help="keep the bench database and logs")
    args = parser.parse_args()
    args.claims = args.claims or (args.max_batch if args.no_fair else 2 * args.max_batch)

    env = bench_environment(args)
    log_dir = ROOT / "var" / "bench-abuse"
    log_dir.mkdir(parents=True, exist_ok=True)
    recreate_database(args.admin_url, BENCH_DB)
    processes: list[subprocess.Popen] = []
    statuses: collections.Counter = collections.Counter()
    try:
        tokens, model, sessions = prepare(args)
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        processes.append(start("web", [str(ROOT / ".venv/bin/gunicorn"), "specops.asgi:application",
                                       "-c", "specops/gunicorn_conf.py", "--bind", f"127.0.0.1:{port}",
                                       "--workers", "1"], env, log_dir))
        processes.append(start("worker", [sys.executable, "-m", "celery", "-A", "specops", "worker", "-Q", "cpu",
                                          "--pool", "threads", "--concurrency", str(args.claims),
                                          "--prefetch-multiplier", "1", "-n", "bench-abuse@%h", "--without-gossip",
                                          "--without-mingle", "-l", "INFO"],
                               {**env, "DATABASE_POOL_MAX_SIZE": str(min(args.claims, 20) + 4)}, log_dir))
        wait_http(f"{base_url}/v1/models")
        say(f"web: one gunicorn uvicorn worker at {base_url}; worker: threads pool, {args.claims} claims, "
            f"SPECOPS_MAX_BATCH={args.max_batch}, fair admission and preemption {'off' if args.no_fair else 'on'}")
        alone = run_probe(args, base_url, tokens["quiet"], statuses)
        say(f"GET {PROBE_PATH} alone: {len(alone)} requests, p50 {percentile(alone, 0.5):.1f} ms, "
            f"p95 {percentile(alone, 0.95):.1f} ms")
        fair = asyncio.run(tenants(args, base_url, tokens, model, statuses, percentile(alone, 0.95), say))
        drain_noisy(say)  # the streams' probe does not share the machine with the noisy backlog
        opened = asyncio.run(open_streams(args, base_url, tokens, sessions, statuses, say))
        loaded = opened["loaded"]
        say(f"GET {PROBE_PATH} with {opened['open_at_end']} streams open: {len(loaded)} requests, "
            f"p50 {percentile(loaded, 0.5):.1f} ms, p95 {percentile(loaded, 0.95):.1f} ms, "
            f"p99 {percentile(loaded, 0.99):.1f} ms; the web process's stream connections to Redis: "
            f"{opened['connections']}")
        share = noisy_share(fair["window"])
        preempted = preemptions(fair["window"])
        waits = {phase: queue_waits_ms(fair[f"{phase}_ids"]) for phase in ("alone", "loaded")}
        worker = {phase: worker_times_ms(fair[f"{phase}_ids"]) for phase in ("alone", "loaded")}
        slowest_loaded = slowest(fair["loaded"], fair["loaded_ids"])
    finally:
        for process in reversed(processes):
            stop_process_group(process)
        if not args.keep:
            from django.db import connections

            connections.close_all()
            drop_database(args.admin_url, BENCH_DB)

    streams: Streams = opened["streams"]
    errors = sum(n for status, n in statuses.items() if not isinstance(status, int) or status >= 500)
    ttft_ratio = percentile(fair["loaded"], 0.95) / percentile(fair["alone"], 0.95)
    say(f"responses: {dict(sorted(statuses.items(), key=str))}")
    say(f"streams: {streams.peak} open at once, {streams.done} ended with done, {len(streams.errors)} errors"
        + (f" (e.g. {streams.errors[:3]})" if streams.errors else ""))
    say(f"quiet TTFT p95: alone {percentile(fair['alone'], 0.95):.0f} ms, while the noisy tenant floods "
        f"{percentile(fair['loaded'], 0.95):.0f} ms (of which the wait for a batch slot: p95 "
        f"{percentile(waits['alone'], 0.95):.0f} ms alone, {percentile(waits['loaded'], 0.95):.0f} ms loaded); "
        f"the noisy tenant's share of the tokens meanwhile: {share:.2f}; preemptions: {preempted}")
    posts = {phase: [POST_MS[i] for i in fair[f"{phase}_ids"] if i in POST_MS] for phase in ("alone", "loaded")}
    opens = {phase: [STREAM_OPEN_MS[i] for i in fair[f"{phase}_ids"] if i in STREAM_OPEN_MS]
             for phase in ("alone", "loaded")}
    for phase in ("alone", "loaded"):
        times = worker[phase]
        say(f"quiet {phase}, the worker's view: claimed -> in the batch p50/p95 {percentile(times['queue'], 0.5):.0f}/"
            f"{percentile(times['queue'], 0.95):.0f} ms after creation, first tokens p50/p95 "
            f"{percentile(times['ttft'], 0.5):.0f}/{percentile(times['ttft'], 0.95):.0f} ms after creation, "
            f"batch rows p50 {percentile(times['rows'], 0.5):.0f}; the client's POST p50/p95 "
            f"{percentile(posts[phase], 0.5):.0f}/{percentile(posts[phase], 0.95):.0f} ms, to its stream's "
            f"headers {percentile(opens[phase], 0.5):.0f}/{percentile(opens[phase], 0.95):.0f} ms")
    for line in slowest_loaded:
        say(f"quiet loaded, one of the slowest: {line}")
    say(f"baseline: other_p95_ms alone {percentile(alone, 0.95):.1f}")
    say(f"RESULT streams_open={opened['open_at_end']} other_p95_ms={percentile(loaded, 0.95):.1f} "
        f"quiet_ttft_loaded_over_alone={ttft_ratio:.2f} noisy_share={share:.2f} server_errors={errors}")


if __name__ == "__main__":
    main()
