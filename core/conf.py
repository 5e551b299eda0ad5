"""Settings of the project package (dashboard SLOs) and the few environment facts read before Django.

``GPU_VISIBLE`` and ``PROMETHEUS_MULTIPROC_DIR`` are read straight from the environment on
purpose: Celery routes and multiprocess metrics need them in processes that never load settings.
"""
from __future__ import annotations

import os

from core.conf_base import AppSettings, Setting

SETTINGS = (
    Setting("SPECOPS_SLO_P95_MS", float, 300.0, "API latency objective, p95"),
    Setting("SPECOPS_SLO_P99_MS", float, 600.0, "API latency objective, p99"),
    # Throttling (both APIs): "<n>/<s|min|hour|day>", or "none" for no limit; counted in Redis.
    Setting("SPECOPS_THROTTLE_USER_RATE", str, "1200/min", "requests per token (user), any API endpoint"),
    Setting("SPECOPS_THROTTLE_TENANT_RATE", str, "6000/min", "requests per tenant, all its tokens together"),
    Setting("SPECOPS_THROTTLE_GENERATION_RATE", str, "120/min",
            "generation requests (sessions created) per token, on top of the user rate"),
    Setting("SPECOPS_THROTTLE_LOGIN_RATE", str, "10/min",
            "admin sign-in attempts per client address, and per username"),
    # Server-sent event streams (/api/v1/sessions/{id}/stream/ and OpenAI stream: true).
    Setting("SPECOPS_STREAM_HEARTBEAT_S", float, 15.0, "an SSE comment after this long without an event"),
    Setting("SPECOPS_STREAM_IDLE_LIMIT_S", float, 300.0,
            "a stream with no event for this long ends with an explicit timeout event"),
    Setting("SPECOPS_STREAM_REDIS_CONNECTIONS", int, 8,
            "Redis connections one web process holds for all its open streams (one reads them all)"),
    Setting("SPECOPS_METRICS_TOKEN", str, "",
            "bearer token a scrape of /metrics must send (empty: /metrics only with DEBUG on, else a 404)"),
    # Tracing (core.tracing): one trace per generation, API request -> Celery task -> writes.
    Setting("SPECOPS_TRACING", str, "off", "span exporter: off (no-op tracer), console or otlp"),
    Setting("SPECOPS_TRACING_OTLP_ENDPOINT", str, "http://127.0.0.1:4318/v1/traces",
            "OTLP/HTTP traces endpoint (SPECOPS_TRACING=otlp)"),
    Setting("SPECOPS_TRACING_CONSOLE_PATH", str, "",
            "file the console exporter appends spans to, one JSON object a line (empty: stdout)"),
    Setting("SPECOPS_TRACING_SAMPLE_RATIO", float, 1.0,
            "share of new traces recorded (a worker follows the request's decision)"),
    # Latency budget per component, against its measured p95: the admin's latency page.
    *(Setting(f"SPECOPS_BUDGET_{name.upper()}_MS", float, default, f"p95 budget of {meaning}")
      for name, default, meaning in (
          ("auth", 10.0, "authentication, tenant and throttles"),
          ("validation", 15.0, "request validation (model lookup, tokenizing the prompt)"),
          ("cache", 5.0, "the prediction-cache lookup"),
          ("db_write", 20.0, "writing the session row"),
          ("enqueue", 10.0, "publishing the task to the broker"),
          ("queue_wait", 250.0, "the wait from the session's creation to joining its device's batch"),
          ("inference", 600.0, "joining the batch to the first token (prefill and the first step)"),
          ("streaming", 20.0, "delivering one streamed step to the client"))),
)

conf = AppSettings(SETTINGS)


def cuda_visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES as set for this process, or None."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def prometheus_multiproc_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")
