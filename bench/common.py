"""What the benchmarks share: progress lines, medians and percentiles, a database of their own,
their own services' processes, and the demo pair.

Imported as ``bench.common``: a benchmark puts the repository root on ``sys.path`` first (it is
run as ``python bench/X.py``, which puts only ``bench/`` there).
"""
from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference.engine.lm.loading import LoadedModel

ROOT = Path(__file__).resolve().parent.parent
ADMIN_URL = "postgres://postgres@127.0.0.1:5432/postgres"

#: The benchmark is one client making every request: the per-user, per-tenant and generation
#: limits would refuse it.
NO_THROTTLES = {
    "SPECOPS_THROTTLE_USER_RATE": "none", "SPECOPS_THROTTLE_TENANT_RATE": "none",
    "SPECOPS_THROTTLE_GENERATION_RATE": "none",
}


def say(line: str) -> None:
    """Print a progress line at once (a long run is read while it runs, often through a pipe)."""
    print(line, flush=True)


# ---------------------------------------------------------------------------------- statistics
def median_ms(action: Callable[[], object], reps: int = 15, warmup: int = 3) -> float:
    """Median milliseconds of ``reps`` calls of ``action``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        action()
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def percentile(values: list[float], q: float) -> float:
    """The value at rank ``int(q * n)`` of the sorted values (NaN when there are none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# ---------------------------------------------------------------------------------- databases
def database_url(admin_url: str, name: str) -> str:
    """The URL of database ``name`` on ``admin_url``'s server."""
    return admin_url.rsplit("/", 1)[0] + f"/{name}"


def recreate_database(admin_url: str, name: str) -> None:
    """Drop database ``name`` (whoever is connected) and create it empty: a run starts clean."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def drop_database(admin_url: str, name: str) -> None:
    """Drop database ``name`` (whoever is connected): a run leaves nothing behind."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ---------------------------------------------------------------------------------- processes
def free_port() -> int:
    """A TCP port nothing listens on now, for a server the benchmark starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group a service was started in (``start_new_session``), SIGKILL
    after 30 s: a worker's or a web server's children go with it."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# ---------------------------------------------------------------------------------- demo pair
def require_demo_pair(model_dir: Path) -> None:
    """Exit with a one-line error when ``model_dir`` holds no demo pair."""
    if not (Path(model_dir) / "demo-target" / "config.json").is_file():
        sys.exit(f"error: no demo pair in {model_dir}; build it first (python manage.py build_demo_models)")


def load_pair_dirs(target_dir: Path, draft_dir: Path, device: str = "cpu") -> tuple[LoadedModel, LoadedModel]:
    """(target, draft) ``LoadedModel``s through production's loading path; a one-line error and
    exit when either directory holds no model."""
    for directory in (target_dir, draft_dir):
        if not (Path(directory) / "config.json").is_file():
            sys.exit(f"error: no model in {directory}; build the demo pair first "
                     "(python manage.py build_demo_models)")
    from inference.engine.lm.loading import load_model_pair

    return load_model_pair(target_dir, draft_dir, device=device)


def load_demo_pair(model_dir: Path, device: str = "cpu") -> tuple[LoadedModel, LoadedModel]:
    """(target, draft) ``LoadedModel``s of ``model_dir``'s demo pair (``demo-target``, ``demo-draft``)."""
    return load_pair_dirs(Path(model_dir) / "demo-target", Path(model_dir) / "demo-draft", device)


def register_tiny_pair(name: str = "tiny") -> str:
    """Build the tiny random pair under SPECOPS_MODEL_DIR (seconds; reused when built) and register
    it as the active target ``name``: what a bench of the serving path runs without the demo pair.
    Django must be set up."""
    from django.conf import settings

    from inference.demo.tiny_models import build_tiny_pair
    from inference.registry import register_pair

    target_dir, draft_dir = build_tiny_pair(settings.SPECOPS_MODEL_DIR, arch="gpt2", seed=0)
    register_pair(name, "1", target_dir, draft_dir)
    return name
