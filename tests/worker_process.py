"""Start a real Celery worker process against the test database and the real broker."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from django.conf import settings
from django.db import connection

from tests.helpers import dies_with_this_run, wait_for

ROOT = Path(__file__).resolve().parent.parent


def database_url(settings_dict: dict) -> str:
    return (f"postgres://{settings_dict['USER']}@{settings_dict['HOST']}:{settings_dict['PORT']}/"
            f"{settings_dict['NAME']}")


def start_worker(queue: str, name: str, log_path: Path, broker_url: str | None = None,
                 extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``celery worker -Q queue`` on the test database; return once it answers a ping.

    The worker runs like production's: a threads pool feeding one batching loop, with the
    speculation policy choosing each step's depth (it used to be switched off here, and a fresh
    worker that never drafted went unseen: issue 25). ``extra_env`` overrides any setting.
    """
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "DATABASE_REPLICA_URLS": ",".join(
            database_url({**settings.DATABASES[alias], "NAME": connection.settings_dict["NAME"]})
            for alias in settings.DATABASE_REPLICAS
        ),
        "SPECOPS_WORKER_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        **(extra_env or {}),
    }
    if broker_url:
        env["CELERY_BROKER_URL"] = broker_url
    node = f"{name}@testhost"
    log = open(log_path, "w")
    process = subprocess.Popen(
        dies_with_this_run(["-m", "celery", "-A", "specops", "worker", "-Q", queue, "-n", node, "--pool", "threads",
                            "--concurrency", "4", "--prefetch-multiplier", "1", "--without-gossip", "--without-mingle",
                            "-l", "INFO"]),
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )

    def ready() -> bool:
        """The worker logs '<node> ready.' once it consumes (whatever the broker)."""
        if process.poll() is not None:
            raise AssertionError(f"worker exited early; see {log_path}")
        return f"{node} ready." in log_path.read_text()

    try:
        wait_for(ready, timeout=90, interval=0.25, what=f"celery worker {node}")
    except BaseException:
        stop_worker(process)  # never leave a worker behind: it would hold its queues for the next run
        raise
    return process


def stop_worker(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
