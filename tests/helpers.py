"""Small helpers for tests that wait on real services."""
from __future__ import annotations

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

