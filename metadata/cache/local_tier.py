"""The in-process tier: cachetools' TTLCache for the size bound and expiry, read without a lock.

cachetools caches are not thread-safe (a ``get`` reorders the LRU list), so every access needs a
lock. Measured under the benchmark's burst (8 threads reading the same sessions), that lock made
convoys: a thread preempted at a GIL switch while holding it stalls every other reader for the
whole switch interval, and p99 went from microseconds to 3-4 ms. So writes go through the locked
TTLCache, which mirrors its live entries into a plain dict, and readers look the dict up without
the lock (a single dict lookup is atomic under the GIL). Reads therefore do not refresh LRU order:
eviction under size pressure is by insertion, which is what a TTL of about a second gives anyway.

Refresh ahead: an entry older than the TTL is not dropped at once. For up to another TTL it is
"due": the first reader that finds it due reloads it (from Redis, usually) while the others keep
using it. Without this, every expiry of a hot key made all the burst's threads wait for one
reload at the same moment. The TTL only bounds how long a lost invalidation broadcast can leave an
entry behind (invalidations evict at once), so the bound becomes twice the TTL.
"""
from __future__ import annotations

import threading
import time

from cachetools import TTLCache

from metadata.cache.redis_tier import Versioned


class _MirroredTTLCache(TTLCache):
    """A TTLCache (TTL: twice ``due_after_s``) that keeps ``view[key] = (value, due_at, expires_at)``
    in step with its contents."""

    def __init__(self, maxsize: int, due_after_s: float, view: dict[str, tuple[Versioned, float, float]]) -> None:
        super().__init__(maxsize, 2 * due_after_s)
        self._view = view
        self._due_after_s = due_after_s

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        now = time.monotonic()
        self._view[key] = (value, now + self._due_after_s, now + 2 * self._due_after_s)

    def __delitem__(self, key) -> None:
        try:
            super().__delitem__(key)
        finally:
            self._view.pop(key, None)

    def expire(self, time=None):
        expired = super().expire(time)
        for key, _ in expired:
            self._view.pop(key, None)
        return expired

    def clear(self) -> None:
        super().clear()
        self._view.clear()


class LocalTier:
    """Versioned entries of one process, plus the highest invalidation position seen per key (an
    entry read before that position is never stored, even if its load finishes afterwards)."""

    def __init__(self, maxsize: int, ttl_s: float) -> None:
        self._lock = threading.Lock()
        self._view: dict[str, tuple[Versioned, float, float]] = {}
        self._entries = _MirroredTTLCache(maxsize, ttl_s, self._view)
        self._floors: TTLCache[str, int] = TTLCache(maxsize, max(10.0, 4 * ttl_s))
        self._refreshing: set[str] = set()

    def get(self, key: str) -> tuple[Versioned, bool] | None:
        """(entry, due for a refresh), or None."""
        item = self._view.get(key)  # no lock: see the module docstring
        if item is None:
            return None
        now = time.monotonic()
        if now >= item[2]:
            return None
        return item[0], now >= item[1]

    def claim_refresh(self, key: str) -> bool:
        """True for the one reader that should reload a due entry (until ``end_refresh``)."""
        with self._lock:
            if key in self._refreshing:
                return False
            self._refreshing.add(key)
            return True

    def end_refresh(self, key: str) -> None:
        with self._lock:
            self._refreshing.discard(key)

    def put(self, key: str, entry: Versioned) -> bool:
        with self._lock:
            if entry.source_lsn < self._floors.get(key, 0):
                return False
            self._entries[key] = entry
            return True

    def evict(self, key: str, position: int) -> None:
        with self._lock:
            self._entries.pop(key, None)
            if position > self._floors.get(key, 0):
                self._floors[key] = position

    def replace(self, key: str, entry: Versioned, position: int) -> bool:
        """Raise the key's floor to ``position`` and put ``entry`` in one step (no gap for readers)."""
        with self._lock:
            if position > self._floors.get(key, 0):
                self._floors[key] = position
            if entry.source_lsn < self._floors[key]:
                self._entries.pop(key, None)
                return False
            self._entries[key] = entry
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None
