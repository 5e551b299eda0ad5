"""Settings of the project package (dashboard SLOs) and the few environment facts read before Django.

``GPU_VISIBLE`` and ``PROMETHEUS_MULTIPROC_DIR`` are read straight from the environment on
purpose: Celery routes and multiprocess metrics need them in processes that never load settings.
"""
from __future__ import annotations

import os

from specops.conf_base import AppSettings, Setting

SETTINGS = (
    Setting("SPECOPS_SLO_P95_MS", float, 300.0, "API latency objective, p95"),
    Setting("SPECOPS_SLO_P99_MS", float, 600.0, "API latency objective, p99"),
    # Throttling (both APIs): "<n>/<s|min|hour|day>", or "none" for no limit; counted in Redis.
    Setting("SPECOPS_THROTTLE_USER_RATE", str, "1200/min", "requests per token (user), any API endpoint"),
    Setting("SPECOPS_THROTTLE_TENANT_RATE", str, "6000/min", "requests per tenant, all its tokens together"),
    Setting("SPECOPS_THROTTLE_GENERATION_RATE", str, "120/min",
            "generation requests (sessions created) per token, on top of the user rate"),
    # Server-sent event streams (/api/v1/sessions/{id}/stream/ and OpenAI stream: true).
    Setting("SPECOPS_STREAM_HEARTBEAT_S", float, 15.0, "an SSE comment after this long without an event"),
    Setting("SPECOPS_STREAM_IDLE_LIMIT_S", float, 300.0,
            "a stream with no event for this long ends with an explicit timeout event"),
    Setting("SPECOPS_STREAM_REDIS_CONNECTIONS", int, 5000,
            "Redis connections one web process may hold for open streams (one blocking read each)"),
)

conf = AppSettings(SETTINGS)


def cuda_visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES as set for this process, or None."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def prometheus_multiproc_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")
