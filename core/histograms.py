"""Mergeable latency histograms: counts over fixed bucket edges, in milliseconds.

A percentile cannot be averaged across minutes, but bucket counts can be added: a minute's
histogram plus the next one's is the histogram of both. The edges are fixed forever (stored
rollups refer to them by index; never change them, add a new series instead) and include every
SLO threshold the dashboard compares with (ITL 100 ms, API p95 300 ms and p99 600 ms, TTFT
1 s), so "share within the SLO" is exact; a percentile is interpolated inside its bucket (edges
are ~1.5x apart, so it is within that factor, and exact at an edge).

Bucket ``i`` counts values in ``[EDGES_MS[i-1], EDGES_MS[i])``; bucket 0 those below the first
edge and the last bucket those at or above the last one. This is PostgreSQL's
``width_bucket(value, EDGES_MS)`` numbering, so SQL and Python agree.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence

EDGES_MS: tuple[float, ...] = (
    0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 150, 200, 300, 450,
    600, 800, 1000, 1500, 2000, 3000, 5000, 7500, 10_000, 15_000, 20_000, 30_000, 60_000, 120_000,
    300_000, 600_000,
)
N_BUCKETS = len(EDGES_MS) + 1


def bucket_of(value_ms: float) -> int:
    """The bucket index of one observation (``width_bucket`` numbering)."""
    return bisect_right(EDGES_MS, value_ms)


def empty() -> list[int]:
    return [0] * N_BUCKETS


def observe(buckets: list[int], value_ms: float, weight: int = 1) -> None:
    buckets[bucket_of(value_ms)] += weight


def merge(histograms: Iterable[Sequence[int]]) -> list[int]:
    """Element-wise sum (a stored histogram may be empty: no observations)."""
    total = empty()
    for histogram in histograms:
        for index, count in enumerate(histogram):
            total[index] += count
    return total


def quantile(buckets: Sequence[int], q: float) -> float | None:
    """The q-quantile (0..1), interpolated inside its bucket; None when there is no observation."""
    n = sum(buckets)
    if not n:
        return None
    rank = q * n
    seen = 0
    for index, count in enumerate(buckets):
        if count and seen + count >= rank:
            low = _LOWS[index]
            return low + (_HIGHS[index] - low) * max(rank - seen, 0.0) / count
        seen += count
    return EDGES_MS[-1]


_LOWS = (0.0, *EDGES_MS)
_HIGHS = (*EDGES_MS, EDGES_MS[-1])
