"""Sessions at run time: their state read through the cache, their writes, streams and request log.

``get_session_state`` / ``get_session_detail`` read a session through the two-tier cache (never
older than the caller's own writes); ``invalidate_session`` drops it after the writer's commit
(``invalidate_sessions``: several at once).
``cache_for(region)`` is a region's process-wide cache; ``build_state_cache`` and
``load_session_state`` build variants of the state cache (tests, the benchmark).
``BatchWriter`` (several models, one transaction a flush), ``BufferedWriter`` and
``insert_ignoring_conflicts`` write token and candidate history in batches;
``token_stream`` is a session's live tokens (Redis Streams), the token table its history;
``history`` joins the two for a reader (``areplay``: committed steps, then live, no gap, no repeat);
``RequestLogMiddleware`` logs API requests into the partitioned request log.

Modules: ``state``, ``writers``, ``token_stream``, ``history``, ``request_log``. ``state`` and ``request_log``
use the models, so import this package once Django is set up (in ``ready()`` or later), never from
settings or a models module.
"""
from __future__ import annotations

from metadata.sessions import history, token_stream
from metadata.sessions.request_log import RequestLogMiddleware
from metadata.sessions.state import (
    DETAIL,
    REGIONS,
    STATE,
    build_state_cache,
    cache_for,
    get_session_detail,
    get_session_state,
    invalidate_session,
    invalidate_sessions,
    load_session_state,
)
from metadata.sessions.writers import BatchWriter, BufferedWriter, insert_ignoring_conflicts

__all__ = [
    "DETAIL", "REGIONS", "STATE", "BatchWriter", "BufferedWriter", "RequestLogMiddleware", "build_state_cache", "cache_for",
    "get_session_detail", "get_session_state", "history", "insert_ignoring_conflicts", "invalidate_session",
    "invalidate_sessions", "load_session_state", "token_stream",
]
