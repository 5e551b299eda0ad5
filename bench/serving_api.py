"""End-to-end part of bench/serving.py: the API's tok/s with a real batching worker, against the engine's own.

Starts, on a database of its own (`specops_bench_serving`, made afresh and dropped at the end)
and a Redis database of its own (`--redis-db` of bench/serving.py, default 7, flushed first:
broker, cache and streams), so a developer's `make run` platform and its registry are left as
they were: one Celery worker on the `cpu` queue as production runs it (threads pool of
SPECOPS_MAX_BATCH, one batching loop) and one ASGI web server; registers the demo pair; then,
at each concurrency c, keeps c requests in flight (POST /api/v1/generations/, temperature 0.7,
no seed so the prediction cache cannot answer) until `requests` have finished, following each
session's stream until it ends. Aggregate tok/s = generated tokens / wall time; TTFT (POST to
the first ``tokens`` event) and ITL (gap between two streamed steps, per token) as the client
sees them. `engine_throughput` runs the same workload (prompt, temperature, drafter, new tokens,
closed loop of c) on the batched engine in this process, with the worker's torch threads: what
the API could make if nothing but the engine cost anything (`api_over_engine`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import (
    ADMIN_URL,
    NO_THROTTLES,
    ROOT,
    database_url,
    drop_database,
    free_port,
    recreate_database,
    stop_process_group,
)

BENCH_QUEUE = "cpu"
BENCH_DB = "specops_bench_serving"
PROMPT = "def parse_config(path):\n    "
TEMPERATURE = 0.7  # no seed: the prediction cache cannot answer


@dataclass
class Measure:
    """One concurrency's figures: tokens per second, and each request's TTFT and per-token ITL."""

    tokens_per_second: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def describe(self) -> str:
        from bench.closed_loop import percentile

        def ms(values, q):
            value = percentile(values, q / 100)
            return f"{value * 1000:.0f}" if value is not None else "-"

        return (f"{self.tokens_per_second:.1f} tok/s, TTFT p50/p95 {ms(self.ttft, 50)}/{ms(self.ttft, 95)} ms, "
                f"ITL p50/p95 {ms(self.itl, 50)}/{ms(self.itl, 95)} ms")


def engine_throughput(target, draft, concurrencies: list[int], requests: int, max_new_tokens: int,
                      threads: int) -> dict[int, Measure]:
    """The API's workload on the batched engine alone, in this process, with ``threads`` torch threads."""
    import torch

    from bench.closed_loop import run_batched
    from inference.engine import GenerationConfig
    from inference.engine.batch.engine import BatchedSpeculativeEngine
    from inference.engine.batch.policy import SpeculationPolicy
    from inference.engine.drafters import DRAFTERS

    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prompt = target.tokenizer(PROMPT)["input_ids"]
        generation = GenerationConfig(max_new_tokens=max_new_tokens, temperature=TEMPERATURE,
                                      eos_token_id=target.tokenizer.eos_token_id)
        gamma = DRAFTERS["draft_model"].draft_config({}).length
        out = {}
        for concurrency in concurrencies:
            engine = BatchedSpeculativeEngine(target, draft, policy=SpeculationPolicy(enabled=True),
                                              max_rows=max(concurrencies))
            run_batched("engine", engine, [prompt], generation, "draft_model", gamma, 1)  # warm-up
            run = run_batched("engine", engine, [prompt] * max(requests, concurrency), generation,
                              "draft_model", gamma, concurrency)
            out[concurrency] = Measure(run.tokens_per_second, run.ttft, run.itl)
        return out
    finally:
        torch.set_num_threads(was)


def _own_services(admin_url: str, redis_db: int) -> None:
    """Point this process (and the worker and web it starts) at the bench's own databases."""
    import redis

    recreate_database(admin_url, BENCH_DB)
    redis_url = f"redis://127.0.0.1:6379/{redis_db}"
    redis.Redis.from_url(redis_url).flushdb()
    os.environ.update({
        "DATABASE_URL": database_url(admin_url, BENCH_DB), "DATABASE_REPLICA_URLS": "",
        "REDIS_URL": redis_url, "CELERY_BROKER_URL": redis_url, "CELERY_RESULT_BACKEND": redis_url,
        **NO_THROTTLES,
    })
    os.environ.setdefault("SECRET_KEY", secrets.token_urlsafe(40))


def _django(model_dir: Path):
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "specops.settings")
    os.environ["SPECOPS_MODEL_DIR"] = str(model_dir)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)


def _register_and_token(model_dir: Path) -> str:
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    from inference.registry import register_pair
    from metadata.models import Tenant, TenantMembership

    dirs = [(model_dir / name).resolve() for name in ("demo-target", "demo-draft")]
    register_pair("demo", "bench", *dirs)  # the bench's own database: nothing else is registered
    user, _ = get_user_model().objects.get_or_create(username="bench-serving")
    tenant, _ = Tenant.objects.get_or_create(name="bench")
    TenantMembership.objects.get_or_create(user=user, defaults={"tenant": tenant})
    token, _ = Token.objects.get_or_create(user=user)
    return token.key


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _wait_ready(check, timeout: float, what: str, processes) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"{what}: a process exited early (see var/bench-*.log)")
        if check():
            return
        time.sleep(0.25)
    raise RuntimeError(f"{what}: not ready after {timeout:.0f} s")


async def _one(client, headers, max_new_tokens: int, measure: Measure) -> int:
    """One generation followed as a client follows it: its SSE stream until the `done` event."""
    body = {"prompt": PROMPT, "max_new_tokens": max_new_tokens, "temperature": TEMPERATURE}
    sent = time.perf_counter()
    created = await client.post("/api/v1/generations/", json=body, headers=headers)
    created.raise_for_status()
    tokens, event, last = 0, None, None
    async with client.stream("GET", created.json()["stream_url"], headers=headers) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("event:"):
                event = line.partition(":")[2].strip()
            elif line.startswith("data:") and event in ("tokens", "done"):
                data = json.loads(line.partition(":")[2])
                if event == "tokens":
                    now, count = time.perf_counter(), len(data["token_ids"])
                    if last is None:
                        measure.ttft.append(now - sent)
                    elif count:
                        measure.itl.extend([(now - last) / count] * count)
                    last = now
                    tokens += count
                elif data["status"] != "succeeded":
                    raise RuntimeError(f"session {data['status']}: {data.get('error')}")
                else:
                    return tokens
    raise RuntimeError("the stream ended without a done event")


async def _measure(base_url: str, token: str, concurrency: int, requests: int,
                   max_new_tokens: int) -> Measure:
    import httpx2 as httpx  # the HTTP client the openai package brings

    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)  # one INFO line per request otherwise
    headers = {"Authorization": f"Token {token}"}
    remaining = requests
    tokens = 0
    measure = Measure()

    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        async def lane() -> None:
            nonlocal remaining, tokens
            while remaining > 0:
                remaining -= 1
                got = await _one(client, headers, max_new_tokens, measure)  # not `tokens += await`: that reads
                tokens += got  # `tokens` before the await and drops the other lanes' counts

        started = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        measure.tokens_per_second = tokens / (time.perf_counter() - started)
        return measure


def _server_side(since: float) -> str:
    """Where the sessions' time to first token went, by the worker's own stats (median): in the
    queue (created -> admitted to the batch) and to the first step (created -> first token)."""
    import statistics
    from datetime import datetime, timezone

    from metadata.models import Session
    from metadata.replicas.lsn import primary_only

    with primary_only():
        stats = list(Session.objects.filter(created_at__gte=datetime.fromtimestamp(since, timezone.utc),
                                            status="succeeded").values_list("stats", flat=True))
    queue = [s["queue_seconds"] for s in stats if s.get("queue_seconds") is not None]
    first = [s["ttft_seconds"] for s in stats if s.get("ttft_seconds") is not None]
    if not queue or not first:
        return "no stats"
    return (f"{len(stats)} sessions, queue {statistics.median(queue) * 1000:.0f} ms, "
            f"first token {statistics.median(first) * 1000:.0f} ms (medians, from the session's creation)")


def api_throughput(model_dir: Path, concurrencies: list[int], requests: int, max_new_tokens: int,
                   admin_url: str = ADMIN_URL,
                   redis_db: int = 7) -> dict[int, Measure]:
    _own_services(admin_url, redis_db)
    try:
        return _api_throughput(model_dir, concurrencies, requests, max_new_tokens)
    finally:
        from django.db import connections

        connections.close_all()
        drop_database(admin_url, BENCH_DB)


def _api_throughput(model_dir: Path, concurrencies: list[int], requests: int,
                    max_new_tokens: int) -> dict[int, Measure]:
    _django(model_dir)
    token = _register_and_token(model_dir)
    from django.conf import settings

    database = settings.DATABASES["default"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SPECOPS_MODEL_DIR": str(model_dir),
           "SPECOPS_MAX_BATCH": str(max(concurrencies)),
           # one torch thread, as scripts/run.sh and the systemd unit start workers (unless set)
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "DATABASE_URL": f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}/{database['NAME']}"}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally` below stops worker and web
    port = free_port()
    logs = ROOT / "var"
    logs.mkdir(exist_ok=True)
    worker = _start([sys.executable, "-m", "celery", "-A", "specops", "worker", "-Q", BENCH_QUEUE,
                     "--pool", "threads", "--concurrency", str(max(concurrencies)),
                     "--prefetch-multiplier", "1", "-n", "bench-serving@%h", "--without-gossip",
                     "--without-mingle", "-l", "INFO"], env, logs / "bench-worker.log")
    web = _start([sys.executable, "-m", "uvicorn", "specops.asgi:application", "--host", "127.0.0.1",
                  "--port", str(port), "--log-level", "warning"], env, logs / "bench-web.log")
    base_url = f"http://127.0.0.1:{port}"
    try:
        import httpx2 as httpx  # the HTTP client the openai package brings

        def web_up() -> bool:
            try:
                return httpx.get(f"{base_url}/api/v1/models/", headers={"Authorization": f"Token {token}"},
                                 timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait_ready(web_up, 60, "web server", [worker, web])
        time.sleep(3)  # the worker connects and preloads the demo pair
        asyncio.run(_measure(base_url, token, 1, 1, 8))  # warm-up: models resident, caches hot
        measures = {}
        for c in concurrencies:
            since = time.time()
            measures[c] = asyncio.run(_measure(base_url, token, c, max(requests, c), max_new_tokens))
            print(f"  server side, c={c}: {_server_side(since)}", flush=True)
        overhead = [line for line in (logs / "bench-worker.log").read_text().splitlines()
                    if "batching loop:" in line and "step reports" in line]
        if overhead:  # the front's time per step against the engine core's (batching_loop.py)
            print("  worker " + overhead[-1].split("INFO/MainProcess]")[-1].strip(), flush=True)
        return measures
    finally:
        for process in (worker, web):
            stop_process_group(process)
