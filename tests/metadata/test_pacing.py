"""The maintenance pacer sleeps in proportion to the busy time it follows."""
from __future__ import annotations

import time

from metadata.partitions.pacing import SLICE_SECONDS, Pacer


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_tick_pauses_as_long_as_the_ratio_says_after_a_slice_of_work() -> None:
    pacer = Pacer(ratio=1.0)
    busy(SLICE_SECONDS / 4)
    started = time.perf_counter()
    pacer.tick()
    assert time.perf_counter() - started < 0.01  # under a slice: no pause yet
    busy(SLICE_SECONDS)
    started = time.perf_counter()
    pacer.tick()
    paused = time.perf_counter() - started
    assert SLICE_SECONDS <= paused < 4 * SLICE_SECONDS and pacer.slept >= SLICE_SECONDS


def test_pause_between_steps_and_a_zero_ratio_never_sleeps(settings) -> None:
    pacer = Pacer(ratio=0.5)
    busy(0.02)
    started = time.perf_counter()
    pacer.pause()
    assert 0.009 <= time.perf_counter() - started < 0.05
    settings.SPECOPS_MAINTENANCE_PAUSE_RATIO = 0
    idle = Pacer()
    busy(SLICE_SECONDS * 2)
    idle.tick()
    idle.pause()
    assert idle.slept == 0
