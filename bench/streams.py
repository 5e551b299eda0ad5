"""Many open SSE streams on one ASGI web process, and the rest of the API meanwhile.

Starts its own services on a database of its own (``specops_bench_streams``, dropped at the end
unless ``--keep``) and a Redis database of its own (``--redis-db``, flushed first): one web
process (gunicorn with one uvicorn worker, as ``scripts/run.sh`` runs it), and one batching
Celery worker with a tiny random model pair (built in seconds under ``var/bench-models``).

Then: ``--streams`` generations are created (``POST /api/v1/generations/``, sampled so the
prediction cache does not answer them, ``--max-tokens`` each), one stream is opened on each
(``GET /api/v1/sessions/{id}/stream/``) before the worker starts, so all of them are open at
once; the worker then runs the sessions while every stream receives its tokens and ``done``.
From the moment all streams are open to the last ``done``, another process times
``GET /api/v1/models/`` every 20 ms. A stream error is a stream that did not end with a
``done`` of a succeeded session (HTTP error, connection error, timeout event, or failure).

    .venv/bin/python bench/streams.py [--streams 500] [--max-tokens 8]

Last line: ``RESULT streams=<n> other_p95_ms=<x> stream_errors=<n>`` (``streams``: the most
streams open at the same moment).
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import secrets
import subprocess
import sys
import time
import urllib.request
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
    say,
    register_tiny_pair,
    stop_process_group,
)

BENCH_DB = "specops_bench_streams"
PROBE_PATH = "/api/v1/models/"


def bench_environment(args) -> dict[str, str]:
    """The environment of this process and of the services it starts."""
    env = {
        "DATABASE_URL": database_url(args.admin_url, BENCH_DB), "DATABASE_REPLICA_URLS": "", "REDIS_URL": f"redis://127.0.0.1:6379/{args.redis_db}",
        "SPECOPS_MODEL_DIR": str(ROOT / "var" / "bench-models"), "HF_HUB_OFFLINE": "1",
        "DJANGO_SETTINGS_MODULE": "specops.settings", "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
        "SECRET_KEY": os.environ.get("SECRET_KEY") or secrets.token_urlsafe(40),
        **NO_THROTTLES,  # the per-token limits would refuse its 500 generations
        "SPECOPS_STREAM_HEARTBEAT_S": str(args.heartbeat_s),
        "SPECOPS_MAX_BATCH": str(args.max_batch),
        "DATABASE_POOL_MAX_SIZE": str(args.pool_size),
    }
    os.environ.update(env)
    return env


def prepare(args) -> tuple[str, str]:
    """Migrate, register the tiny pair, make a tenant and a token; return (token, model name)."""
    import django

    django.setup()
    import redis
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from rest_framework.authtoken.models import Token

    from metadata.models import Tenant, TenantMembership

    redis.Redis.from_url(settings.REDIS_URL).flushdb()
    call_command("migrate", verbosity=0)
    model = register_tiny_pair()
    user = get_user_model().objects.create_user("bench", password=secrets.token_urlsafe(12))
    TenantMembership.objects.create(user=user, tenant=Tenant.objects.create(name="bench-streams"))
    token = Token.objects.create(user=user).key
    from django.db import connections

    connections.close_all()
    return token, model


def start(name: str, command: list[str], env: dict[str, str], log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 (the child process writes it)
    return subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_http(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return  # 401: it serves
        except OSError:
            time.sleep(0.25)
    raise SystemExit(f"{url} did not answer within {timeout:g} s")


def probe(base_url: str, token: str, interval_s: float, stop_event, results) -> None:
    """Time GET /api/v1/models/ until told to stop (another process: the client's loop is busy)."""
    import httpx2

    latencies, errors = [], 0
    with httpx2.Client(base_url=base_url, headers={"Authorization": f"Token {token}"}, timeout=30) as client:
        while not stop_event.is_set():
            started = time.perf_counter()
            try:
                ok = client.get(PROBE_PATH).status_code == 200
            except Exception:  # noqa: BLE001 (any failure is a probe error)
                ok = False
            latencies.append((time.monotonic(), (time.perf_counter() - started) * 1000))
            errors += not ok
            time.sleep(max(0.0, interval_s - (time.perf_counter() - started)))
    results.put((latencies, errors))


class StreamStats:
    def __init__(self) -> None:
        self.open = 0
        self.peak = 0
        self.errors = 0
        self.first_event_at: float | None = None
        self.error_samples: list[str] = []

    def opened(self) -> None:
        self.open += 1
        self.peak = max(self.peak, self.open)

    def closed(self, error: str | None) -> None:
        self.open -= 1
        if error:
            self.errors += 1
            if len(self.error_samples) < 5:
                self.error_samples.append(error)


async def follow(client, session_id: str, stats: StreamStats, timeout_s: float) -> None:
    """Read one stream to its end; an error is anything but a succeeded ``done``."""
    error: str | None = "no done event"
    counted = False
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("GET", f"/api/v1/sessions/{session_id}/stream/") as response:
                if response.status_code != 200:
                    error = f"HTTP {response.status_code}"
                    return
                stats.opened()
                counted = True
                event = None
                async for line in response.aiter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                        if event == "tokens" and stats.first_event_at is None:
                            stats.first_event_at = time.monotonic()
                    elif line.startswith("data:") and event in ("done", "timeout"):
                        ok = event == "done" and '"status": "succeeded"' in line
                        error = None if ok else f"{event}: {line[5:].strip()[:120]}"
                        break
    except Exception as exc:  # noqa: BLE001 (every failure of a stream is counted)
        error = f"{type(exc).__name__}: {exc}"[:160]
    finally:
        if counted:
            stats.closed(error)
        else:
            stats.errors += 1
            if len(stats.error_samples) < 5:
                stats.error_samples.append(error or "?")


async def create_sessions(client, count: int, model: str, max_tokens: int) -> list[str]:
    semaphore = asyncio.Semaphore(16)

    async def create(number: int) -> str:
        async with semaphore:
            body = {"prompt": f"def handler_{number}(request):\n    ", "model": model,
                    "max_new_tokens": max_tokens, "temperature": 0.8}
            response = await client.post("/api/v1/generations/", json=body)
            response.raise_for_status()
            return response.json()["id"]

    return await asyncio.gather(*(create(n) for n in range(count)))


async def run_streams(args, base_url: str, token: str, model: str, start_worker, log) -> dict:
    import httpx2

    limits = httpx2.Limits(max_connections=args.streams + 50, max_keepalive_connections=args.streams + 50)
    async with httpx2.AsyncClient(base_url=base_url, headers={"Authorization": f"Token {token}"},
                                  timeout=httpx2.Timeout(60, read=args.stream_timeout_s), limits=limits) as client:
        started = time.perf_counter()
        sessions = await create_sessions(client, args.streams, model, args.max_tokens)
        log(f"created {len(sessions)} generations in {time.perf_counter() - started:.1f} s (no worker yet)")
        stats = StreamStats()
        tasks = [asyncio.create_task(follow(client, s, stats, args.stream_timeout_s)) for s in sessions]
        while stats.open + stats.errors < len(sessions):
            await asyncio.sleep(0.05)
        opened_at = time.monotonic()
        log(f"{stats.open} streams open ({stats.errors} failed to open) in {time.perf_counter() - started:.1f} s")
        probe_stop, probe_results = start_worker()
        await asyncio.gather(*tasks)
        ended_at = time.monotonic()
        probe_stop.set()
        latencies, probe_errors = probe_results.get(timeout=60)
        return {"stats": stats, "opened_at": opened_at, "ended_at": ended_at, "latencies": latencies,
                "probe_errors": probe_errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=16, help="SPECOPS_MAX_BATCH of the worker")
    parser.add_argument("--pool-size", type=int, default=8, help="DATABASE_POOL_MAX_SIZE of the web process")
    parser.add_argument("--heartbeat-s", type=float, default=15.0)
    parser.add_argument("--stream-timeout-s", type=float, default=600.0)
    parser.add_argument("--probe-interval-s", type=float, default=0.02)
    parser.add_argument("--admin-url", default=ADMIN_URL)
    parser.add_argument("--redis-db", type=int, default=6)
    parser.add_argument("--keep", action="store_true", help="keep the bench database and logs")
    args = parser.parse_args()

    env = bench_environment(args)
    log_dir = ROOT / "var" / "bench-streams"
    log_dir.mkdir(parents=True, exist_ok=True)
    recreate_database(args.admin_url, BENCH_DB)
    processes: list[subprocess.Popen] = []
    try:
        token, model = prepare(args)
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        processes.append(start("web", [str(ROOT / ".venv/bin/gunicorn"), "specops.asgi:application",
                                       "-c", "specops/gunicorn_conf.py", "--bind", f"127.0.0.1:{port}",
                                       "--workers", "1"], env, log_dir))
        wait_http(f"{base_url}/v1/models")
        say(f"web: one gunicorn uvicorn worker at {base_url}; worker: threads pool, SPECOPS_MAX_BATCH={args.max_batch}")
        ctx = mp.get_context("spawn")
        probe_stop, probe_results = ctx.Event(), ctx.Queue()

        def start_worker():
            processes.append(start("worker", [sys.executable, "-m", "celery", "-A", "specops", "worker", "-Q", "cpu",
                                              "--pool", "threads", "--concurrency", str(args.max_batch),
                                              "--prefetch-multiplier", "1", "-n", "bench-streams@%h", "-l", "INFO"],
                                   # Each pool thread holds a connection while its session runs.
                                   {**env, "SPECOPS_WORKER_DEVICE": "cpu",
                                    "DATABASE_POOL_MAX_SIZE": str(args.max_batch + 4)}, log_dir))
            ctx.Process(target=probe, args=(base_url, token, args.probe_interval_s, probe_stop, probe_results),
                        daemon=True).start()
            return probe_stop, probe_results

        outcome = asyncio.run(run_streams(args, base_url, token, model, start_worker, say))
    finally:
        for process in reversed(processes):
            stop_process_group(process)
        if not args.keep:
            drop_database(args.admin_url, BENCH_DB)

    stats: StreamStats = outcome["stats"]
    samples = outcome["latencies"]
    latencies = [ms for _, ms in samples]
    live_from = stats.first_event_at or outcome["ended_at"]
    live = [ms for at, ms in samples if at >= live_from]
    say(f"streams: {stats.peak} open at once, {stats.errors} errors"
        + (f" (e.g. {stats.error_samples})" if stats.error_samples else ""))
    say(f"generation: {args.streams} sessions x {args.max_tokens} tokens; first token to last done "
        f"{outcome['ended_at'] - live_from:.1f} s; streams open {outcome['ended_at'] - outcome['opened_at']:.1f} s "
        "in all (worker start included)")
    say(f"GET {PROBE_PATH} while the streams were open: {len(latencies)} requests, {outcome['probe_errors']} errors, "
        f"p50 {percentile(latencies, 0.5):.1f} ms, p95 {percentile(latencies, 0.95):.1f} ms, "
        f"p99 {percentile(latencies, 0.99):.1f} ms, max {max(latencies, default=float('nan')):.1f} ms")
    say(f"  of which while tokens flowed: {len(live)} requests, p50 {percentile(live, 0.5):.1f} ms, "
        f"p95 {percentile(live, 0.95):.1f} ms, p99 {percentile(live, 0.99):.1f} ms")
    say(f"RESULT streams={stats.peak} other_p95_ms={percentile(latencies, 0.95):.1f} stream_errors={stats.errors}")


if __name__ == "__main__":
    main()
