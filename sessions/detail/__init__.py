"""One session as the admin shows it: its page (``page``) and its latencies as its client saw them (``timings``)."""
from __future__ import annotations

from sessions.detail import page
from sessions.detail.timings import SessionTimings, timings_of

__all__ = ["SessionTimings", "page", "timings_of"]
