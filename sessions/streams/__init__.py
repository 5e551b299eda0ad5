"""A session's token stream: fenced publishes, one reader per web process, its history, and the one follow.

``token_stream`` is a session's live steps in a Redis Stream: a run publishes each step under
its fence (``publish_many``), a claim begins its run on it (``begin_run``), ``done`` seals it,
and ``afollow`` reads it from the event loop through the process's ``stream_hub``. ``replay``
joins it to the token table (the record), so a reader gets every committed step once and in
order; ``follow`` is that join for every web reader (the sessions API's stream and the OpenAI
protocol's replies), with the tenant's open-stream slot (``StreamSlot``).
"""
from __future__ import annotations

from sessions.streams import replay, stream_hub, token_stream
from sessions.streams.follow import StreamLimitReached, StreamSlot, follow
from sessions.streams.stream_hub import StreamEntry
from sessions.streams.token_stream import HEARTBEAT, IDLE_LIMIT, StreamEvent

__all__ = [
    "HEARTBEAT", "IDLE_LIMIT", "StreamEntry", "StreamEvent", "StreamLimitReached", "StreamSlot", "follow", "replay",
    "stream_hub", "token_stream",
]
