"""A device worker's task threads shared across tenants: the claim share.

Each task thread of a device worker holds one session from its claim to its end
(lifecycle.run_session), so the worker's threads (Celery's ``--concurrency``) are the sessions
it holds: the batch's rows and those waiting in its engine for a row. The broker hands a quiet
tenant's message out first (sessions.submission.broker_priority), and the engine admits it
first (inference/engine/batch/fair_admission.py), but only once a thread takes it: first come,
first served, a busy tenant's backlog holds every thread, and the next tenant's message waits
until one of its sessions ends (measured: most of a quiet tenant's time to first token under a
flood, bench/README.md "Abuse").

The rule: a session takes a thread when at least ``reserve`` threads stay free after it, or when
its tenant holds fewer than its floor (the batch's rows split over the tenants holding threads,
itself included). Otherwise its message goes back to the broker with a countdown
(inference.tasks.generate), so the last ``reserve`` threads are there for the tenants under
their floor. A tenant alone fills the batch and keeps ``threads - rows - reserve`` sessions
waiting for its rows; a worker with no thread beyond its rows has no reserve (the rule is off).

Hand-written: Celery has no per-key concurrency limit (its rate limits are per task type).
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

# How long a deferred message waits before a worker tries it again: doubling from the first,
# capped, so a backlog that waits for its tenant's threads costs a few messages a second.
FIRST_DEFERRAL_S = 0.25
LONGEST_DEFERRAL_S = 2.0


def deferral_countdown_s(deferrals: int) -> float:
    """The countdown of a message deferred ``deferrals`` times before (0 for the first)."""
    return min(LONGEST_DEFERRAL_S, FIRST_DEFERRAL_S * 2 ** max(0, deferrals))


def automatic_reserve(threads: int, rows: int) -> int:
    """The threads kept for tenants under their floor when none is configured: a quarter of the
    threads, no more than those beyond the batch's rows (none when the threads are the rows)."""
    return max(0, min(threads // 4, threads - rows))


@dataclass(frozen=True)
class ShareState:
    threads: int
    reserve: int
    rows: int
    held: dict  # tenant -> threads it holds


class ClaimShare:
    """The threads each tenant holds on this worker, and whether one more may take a thread."""

    def __init__(self, threads: int, reserve: int, rows: int) -> None:
        if threads < 1 or rows < 1:
            raise ValueError("threads and rows must be at least 1")
        if not 0 <= reserve < threads:
            raise ValueError(f"reserve must be at least 0 and below the threads ({threads})")
        self.threads, self.reserve, self.rows = threads, reserve, rows
        self._held: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def floor(self, tenant) -> int:
        """The threads ``tenant`` may take from the reserve: the rows over the tenants holding threads."""
        tenants = len(self._held) + (tenant not in self._held)
        return max(1, self.rows // tenants)

    def try_take(self, tenant) -> bool:
        """Take a thread for a session of ``tenant``; False when its message should be deferred."""
        with self._lock:
            free_after = self.threads - sum(self._held.values()) - 1
            if free_after >= self.reserve or (free_after >= 0 and self._held[tenant] < self.floor(tenant)):
                self._held[tenant] += 1
                return True
            return False

    def give_back(self, tenant) -> None:
        with self._lock:
            self._held[tenant] -= 1
            if self._held[tenant] <= 0:
                del self._held[tenant]

    def state(self) -> ShareState:
        with self._lock:
            return ShareState(self.threads, self.reserve, self.rows, dict(self._held))


_share: ClaimShare | None = None


def configure(threads: int, rows: int, reserve: int | None = None) -> ClaimShare | None:
    """Set this worker's share (at its start: inference.tasks); None, and no share, without a reserve."""
    global _share
    reserve = automatic_reserve(threads, rows) if reserve is None or reserve < 0 else min(reserve, threads - 1)
    _share = ClaimShare(threads, reserve, rows) if reserve > 0 else None
    return _share


def current() -> ClaimShare | None:
    """This worker's share; None where no worker configured one (the rule is off)."""
    return _share


def reset() -> None:
    global _share
    _share = None
