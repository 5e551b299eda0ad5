"""Server-sent events: the message format and the response that carries them.

A message is ``field: value`` lines and a blank line; a line starting with ``:`` is a comment,
which clients ignore (the heartbeat: it keeps proxies and idle timers from closing the stream).
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from django.http import StreamingHttpResponse

HEARTBEAT = ": heartbeat\n\n"


def sse_message(data: str, *, event: str | None = None, event_id: str | None = None) -> str:
    lines = []
    if event_id:
        lines.append(f"id: {event_id}")
    if event:
        lines.append(f"event: {event}")
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return "\n".join(lines) + "\n\n"


def sse_response(messages: AsyncIterator[str], headers: dict[str, str] | None = None) -> StreamingHttpResponse:
    """Stream ``messages`` unbuffered (no proxy buffering, no caching)."""
    response = StreamingHttpResponse(messages, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    for name, value in (headers or {}).items():
        response[name] = value
    return response
