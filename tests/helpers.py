"""Small helpers for tests that wait on real services."""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(probe: Callable[[], T], timeout: float = 30.0, interval: float = 0.1, what: str = "condition") -> T:
    """Call ``probe`` until it returns a truthy value; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value: {value!r})")
        time.sleep(interval)


def generate_and_wait(client, body: dict, timeout: float = 120.0) -> dict:
    """POST a generation with `client`, then poll its session until it ends; return the session body."""
    created = client.post("/api/v1/generations/", body, format="json")
    assert created.status_code == 202, created.content
    session_id = created.json()["id"]

    def finished():
        session = client.get(f"/api/v1/sessions/{session_id}/").json()
        return session if session["status"] in ("succeeded", "failed", "cancelled") else None

    return wait_for(finished, timeout=timeout, what="the generation to finish")


def claim(session) -> int | None:
    """Claim ``session`` as a worker's task does (``sessions.runs.claim_session``) and set the run's
    fence on the instance: the fence, or None when another run holds it."""
    from sessions.runs import claim_session

    claimed = claim_session(session.pk)
    if claimed is None:
        return None
    session.attempts = claimed.attempts
    return claimed.attempts


def broker_lists(queue: str = "cpu") -> list[bytes]:
    """The Redis broker's lists of ``queue``: Celery keeps one per priority level (``cpu``,
    ``cpu\x06\x163``, ...), so a message of any priority is in one of them."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    try:
        return [key for key in client.scan_iter(f"{queue}*") if client.type(key) == b"list"]
    finally:
        client.close()


def queued_messages(queue: str = "cpu") -> int:
    """Messages waiting on the real broker's ``queue``, every priority level's list included."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    try:
        return sum(client.llen(key) for key in broker_lists(queue))
    finally:
        client.close()


def empty_queue(queue: str = "cpu") -> None:
    """Delete every priority level's list of ``queue`` on the real broker."""
    import redis
    from django.conf import settings

    keys = broker_lists(queue)
    if keys:
        redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(*keys)



# Linux's PR_SET_PDEATHSIG, set in the child before it becomes the service: it survives the exec
# and sends SIGTERM when the test run that started it dies. A worker left by a killed run went on
# consuming the shared broker's queues and took the next run's tasks to a dropped database.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit("the test run that started this process is gone")
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def dies_with_this_run(python_args: list[str]) -> list[str]:
    """The command line of ``python <python_args>`` for a service a test starts (a worker, a web
    process), ended by the kernel when this test process dies, however it dies (a SIGKILL, a
    timeout): nothing the run started outlives it. (subprocess's ``preexec_fn`` would do the same
    in the child, but it is not safe in a process with threads, as a test run is.) The kernel
    sends the signal when the *thread* that started the child ends, so a service started from
    another thread (tests/core/test_pgbouncer.py starts two side by side) is started plainly."""
    if threading.current_thread() is not threading.main_thread():
        return [sys.executable, *python_args]
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *python_args]
