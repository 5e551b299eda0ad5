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
