"""Pace background maintenance so it yields CPU to the application's writers.

Archival (COPY, gzip, checksums) is CPU work on the same machine as the writers; unpaced, a
rotation on a small host takes a core away from them for its whole run. Like autovacuum's cost
delay, the pacer sleeps ``pause_ratio`` times as long as maintenance has just been busy, so a
ratio of 1.0 keeps it busy at most half the time; the rotation takes longer, and nobody waits on
it.
"""
from __future__ import annotations

import time

from metadata.conf import conf

SLICE_SECONDS = 0.05  # pause after about this much busy time


def pause_ratio() -> float:
    return float(conf.MAINTENANCE_PAUSE_RATIO)


class Pacer:
    """Call ``tick()`` in maintenance loops; it sleeps in proportion to the busy time since the
    last pause. ``ratio=0`` never sleeps."""

    def __init__(self, ratio: float | None = None) -> None:
        self.ratio = pause_ratio() if ratio is None else ratio
        self.busy_since = time.perf_counter()
        self.slept = 0.0

    def tick(self) -> None:
        busy = time.perf_counter() - self.busy_since
        if self.ratio > 0 and busy >= SLICE_SECONDS:
            pause = busy * self.ratio
            time.sleep(pause)
            self.slept += pause
            self.busy_since = time.perf_counter()

    def pause(self) -> None:
        """Pause for whatever busy time has accrued (between steps), however short."""
        busy = time.perf_counter() - self.busy_since
        if self.ratio > 0 and busy > 0:
            time.sleep(busy * self.ratio)
            self.slept += busy * self.ratio
        self.busy_since = time.perf_counter()
