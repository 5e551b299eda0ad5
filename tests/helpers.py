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
