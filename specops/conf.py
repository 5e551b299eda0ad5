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
)

conf = AppSettings(SETTINGS)


def cuda_visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES as set for this process, or None."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def prometheus_multiproc_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")
