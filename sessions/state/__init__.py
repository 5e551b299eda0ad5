"""A session's state and detail through the two-tier cache (``cache``), never older than the caller's writes.

``get_session_state`` / ``get_session_detail`` read a session (with ``tenant_id``: only that
tenant's); ``session_tenant`` is its tenant. ``cache_for(region)`` is a region's process-wide
cache; ``build_state_cache`` and ``load_session_state`` build variants of the state cache (tests,
the benchmark). ``invalidate_session`` / ``invalidate_sessions`` and ``seed_new_session_state``
are for this package's own writes.
"""
from __future__ import annotations

from sessions.state.cache import (
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
    load_session_states,
    seed_new_session_state,
    session_tenant,
)

__all__ = [
    "DETAIL", "REGIONS", "STATE", "build_state_cache", "cache_for", "get_session_detail", "get_session_state",
    "invalidate_session", "invalidate_sessions", "load_session_state", "load_session_states",
    "seed_new_session_state", "session_tenant",
]
