"""The web tier's generation POST alone: ``POST /api/v1/generations/`` from K keep-alive clients.

Starts its own web server as ``scripts/run.sh`` does (gunicorn with uvicorn workers,
``--web-workers``, 75 s keep-alive) on a database of its own (``specops_bench_post``, dropped at
the end unless ``--keep``) and a Redis database of its own (``--redis-db``, flushed first), with
the tiny random model pair registered as the served target. No worker runs: each session stays
queued and its task waits in the broker (flushed with the database at the end). Every client is
one tenant with one API user and token (as ``manage.py loadtest_tenants`` makes them), its quota
far above what it submits (the quota is still counted and locked on every request); the throttles
are on, at rates no client reaches (their Redis pipeline stays in the path).

Two phases, each ``--seconds`` long after ``--warmup-s`` untimed: one client (the baseline), then
``--concurrency`` clients, split over ``--client-procs`` processes (asyncio + httpx2, one
keep-alive connection each, a closed loop: each answer is followed at once by the next request).
Every request is a sampled generation (temperature 0.8, a prompt of its own), so the prediction
cache never answers it. A server error is any 5xx or failed connection.

    .venv/bin/python bench/generation_post.py [--concurrency 16] [--seconds 20] [--web-workers 2]

Last line: ``RESULT post_p95_ms_c16=<x> post_p95_ms_c1=<x> post_c16_over_c1_p95=<x> server_errors=<n>``
(the key names the concurrency: ``c<K>``).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing as mp
import os
import secrets
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    ADMIN_URL,
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

BENCH_DB = "specops_bench_post"
PATH = "/api/v1/generations/"
HIGH_RATE = "100000/min"  # the throttles run (one Redis pipeline a request) but never refuse


def bench_environment(args) -> dict[str, str]:
    """The environment of this process and of the web server it starts."""
    env = {
        "DATABASE_URL": database_url(args.admin_url, BENCH_DB), "DATABASE_REPLICA_URLS": "",
        "REDIS_URL": f"redis://127.0.0.1:6379/{args.redis_db}",
        "SPECOPS_MODEL_DIR": str(ROOT / "var" / "bench-models"), "HF_HUB_OFFLINE": "1",
        "DJANGO_SETTINGS_MODULE": "specops.settings", "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
        "SECRET_KEY": os.environ.get("SECRET_KEY") or secrets.token_urlsafe(40),
        "SPECOPS_THROTTLE_USER_RATE": HIGH_RATE, "SPECOPS_THROTTLE_TENANT_RATE": HIGH_RATE,
        "SPECOPS_THROTTLE_GENERATION_RATE": HIGH_RATE,
        "PROMETHEUS_MULTIPROC_DIR": str(ROOT / "var" / "bench-post" / "prometheus"),
    }
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):  # both are REDIS_URL's database
        os.environ.pop(name, None)
    os.environ.update(env)
    return env


def prepare(clients: int) -> tuple[str, list[str]]:
    """Migrate, register the tiny pair, make one tenant, user and token per client (the baseline's
    first, then the concurrent phase's: each phase counts only its own tenants' sessions)."""
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connections
    from rest_framework.authtoken.models import Token

    from metadata.models import Tenant, TenantMembership
    from sessions.streams import token_stream

    token_stream.client().flushdb()
    call_command("migrate", verbosity=0)
    model = register_tiny_pair()
    tokens = []
    for number in range(1 + clients):
        tenant = Tenant.objects.create(name=f"bench-post-{number}", max_live_generations=1_000_000)
        user = get_user_model().objects.create_user(f"bench-post-{number}", password=secrets.token_urlsafe(12))
        TenantMembership.objects.create(user=user, tenant=tenant)
        tokens.append(Token.objects.create(user=user).key)
    connections.close_all()
    return model, tokens


async def drive(base_url: str, tokens: list[str], model: str, warmup_s: float, seconds: float, tag: str):
    """One closed-loop client per token: ([latency ms of each timed POST], {status: count})."""
    import httpx2

    latencies: list[float] = []
    statuses: collections.Counter = collections.Counter()
    started = time.monotonic()
    timed_from, deadline = started + warmup_s, started + warmup_s + seconds

    async def client_loop(number: int, token: str) -> None:
        async with httpx2.AsyncClient(base_url=base_url, headers={"Authorization": f"Token {token}"},
                                      timeout=httpx2.Timeout(60)) as client:
            request = 0
            while time.monotonic() < deadline:
                body = {"prompt": f"def {tag}_{number}_{request}(x):\n    ", "model": model,
                        "max_new_tokens": 16, "temperature": 0.8}
                request += 1
                began = time.monotonic()
                try:
                    status = (await client.post(PATH, json=body)).status_code
                except httpx2.HTTPError as exc:
                    status = type(exc).__name__
                if began >= timed_from:
                    statuses[status] += 1
                    latencies.append((time.monotonic() - began) * 1000)

    await asyncio.gather(*(client_loop(n, t) for n, t in enumerate(tokens)))
    return latencies, dict(statuses)


def client_process(base_url, tokens, model, warmup_s, seconds, tag, results) -> None:
    results.put(asyncio.run(drive(base_url, tokens, model, warmup_s, seconds, tag)))


def run_phase(args, base_url: str, tokens: list[str], model: str, tag: str) -> dict:
    """The phase's clients over ``--client-procs`` processes (one for a single client)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = min(args.client_procs, len(tokens))
    shares = [tokens[i::procs] for i in range(procs)]
    processes = [ctx.Process(target=client_process, args=(base_url, share, model, args.warmup_s,
                                                          args.seconds, f"{tag}_{i}", results))
                 for i, share in enumerate(shares)]
    for process in processes:
        process.start()
    latencies: list[float] = []
    statuses: collections.Counter = collections.Counter()
    for _ in processes:
        got, counted = results.get(timeout=args.warmup_s + args.seconds + 300)
        latencies += got
        statuses.update(counted)
    for process in processes:
        process.join()
    return {"latencies": latencies, "statuses": statuses,
            "rate": len(latencies) / args.seconds, "clients": len(tokens)}


def report(name: str, phase: dict) -> None:
    lat = phase["latencies"]
    say(f"{name}: {phase['clients']} client(s), {len(lat)} POSTs in the timed window, {phase['rate']:.1f} req/s; "
        f"p50 {percentile(lat, 0.5):.1f} ms, p95 {percentile(lat, 0.95):.1f} ms, p99 {percentile(lat, 0.99):.1f} ms; "
        f"responses {dict(sorted(phase['statuses'].items(), key=str))}")


def server_errors(phase: dict) -> int:
    return sum(n for status, n in phase["statuses"].items() if not isinstance(status, int) or status >= 500)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds of each phase")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="untimed seconds before each phase's timing")
    parser.add_argument("--web-workers", type=int, default=2, help="gunicorn workers (scripts/run.sh: WEB_WORKERS, 2)")
    parser.add_argument("--client-procs", type=int, default=2, help="processes the concurrent clients run in")
    parser.add_argument("--admin-url", default=ADMIN_URL)
    parser.add_argument("--redis-db", type=int, default=12)
    parser.add_argument("--keep", action="store_true", help="keep the bench database and the web log")
    args = parser.parse_args()

    env = bench_environment(args)
    log_dir = ROOT / "var" / "bench-post"
    (log_dir / "prometheus").mkdir(parents=True, exist_ok=True)
    recreate_database(args.admin_url, BENCH_DB)
    web = None
    try:
        model, tokens = prepare(args.concurrency)
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        web = start("web", [str(ROOT / ".venv/bin/gunicorn"), "specops.asgi:application",
                            "-c", "specops/gunicorn_conf.py", "--bind", f"127.0.0.1:{port}",
                            "--workers", str(args.web_workers), "--keep-alive", "75"], env, log_dir)
        wait_http(f"{base_url}/v1/models")
        say(f"web: {args.web_workers} gunicorn uvicorn worker(s) at {base_url}; no model worker (sessions stay "
            f"queued); {args.seconds:g} s timed per phase after {args.warmup_s:g} s of warm-up")
        alone = run_phase(args, base_url, tokens[:1], model, "c1")
        report("c=1", alone)
        loaded = run_phase(args, base_url, tokens[1:], model, f"c{args.concurrency}")
        report(f"c={args.concurrency}", loaded)
    finally:
        if web is not None:
            stop_process_group(web)
        if not args.keep:
            from django.db import connections

            connections.close_all()
            drop_database(args.admin_url, BENCH_DB)
            try:
                from sessions.streams import token_stream

                token_stream.client().flushdb()  # the queued tasks and the caches' keys
            except Exception as exc:  # noqa: BLE001 (cleanup: report, do not mask the run's error)
                say(f"could not flush redis db {args.redis_db}: {exc}")

    p95_1, p95_k = percentile(alone["latencies"], 0.95), percentile(loaded["latencies"], 0.95)
    k = args.concurrency
    say(f"baseline: post_p95_ms_c1 {p95_1:.1f}")
    say(f"RESULT post_p95_ms_c{k}={p95_k:.1f} post_p95_ms_c1={p95_1:.1f} post_c{k}_over_c1_p95={p95_k / p95_1:.2f} "
        f"server_errors={server_errors(alone) + server_errors(loaded)}")


if __name__ == "__main__":
    main()
