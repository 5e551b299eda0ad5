"""A session's events for a web reader: its committed steps, then the live ones, then its end.

The one follow of a session's stream, for every async view that reads one (the metadata API's
``/sessions/{id}/stream/`` and the OpenAI protocol's replies): ``metadata.sessions.history``
joins the token table and the Redis stream, and a session that ended without a ``done`` (its
worker died, it was cancelled) gets one made from its row. The database reads run off the event
loop and give their connection back at once (``run_db``): a stream may stay open for minutes.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from core.conf import conf
from metadata.api.async_views import run_db
from metadata.sessions import history, token_stream


def follow(session_id, after: str = "0-0", *, idle_limit_s: float) -> AsyncIterator[token_stream.StreamEntry | str]:
    """Yield the session's events after entry id ``after``, each step once and in order.

    Items are ``StreamEntry`` (``tokens`` per step, ``done`` last), ``token_stream.HEARTBEAT``
    after each ``SPECOPS_STREAM_HEARTBEAT_S`` without one, and ``token_stream.IDLE_LIMIT`` (the
    last item) after ``idle_limit_s``.
    """
    return history.areplay(
        session_id, after, heartbeat_s=conf.STREAM_HEARTBEAT_S, idle_limit_s=idle_limit_s,
        committed=lambda step: run_db(history.committed_steps, session_id, step),
        ended=lambda: run_db(token_stream.ended_event, session_id))
