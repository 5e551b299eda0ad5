"""The fault bench's stream clients (bench/faults.py): one per faulted session, following its
stream from the first event, as an application reading ``/sessions/{id}/stream/`` does.

Each client runs the web's own follow (``sessions.streams.follow``: the committed steps from
the token table, then the live ones from Redis, then the end) on one event loop in a thread of
the bench, and, like an SSE client with ``Last-Event-ID``, opens it again after the last event it
got whenever it breaks (a Redis or PostgreSQL restart, a flushed stream) or goes idle. What it
was streamed is compared with what the session stores once it ended (``stream_ok``).
"""
from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing
from dataclasses import dataclass, field

IDLE_LIMIT_S = 30.0  # then the client opens the stream again (a takeover is quiet for a lease and more)
RECONNECT_S = 0.5


@dataclass
class Streamed:
    """What one client got: each ``tokens`` event's step and ids in the order they came, the
    ``done`` event's data, and how often it had to open the stream again."""

    steps: list[tuple[int, list[int]]] = field(default_factory=list)
    done: dict | None = None
    reopened: int = 0
    ended: threading.Event = field(default_factory=threading.Event)

    @property
    def tokens(self) -> list[int]:
        return [token for _step, ids in self.steps for token in ids]


def is_prefix(streamed: list[int], stored: list[int]) -> bool:
    """The invariant: what a client was streamed is a prefix of what the session stores."""
    return stored[:len(streamed)] == streamed


class StreamClients:
    """Stream clients of many sessions on one event loop (a daemon thread); Django must be set up."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.streams: dict[str, Streamed] = {}
        self._tasks: list[asyncio.Future] = []
        self._thread = threading.Thread(target=self.loop.run_forever, name="bench-stream-clients", daemon=True)
        self._thread.start()

    def follow(self, session_id: str) -> Streamed:
        """Start following ``session_id``'s stream from its first event."""
        streamed = self.streams[session_id] = Streamed()
        self._tasks.append(asyncio.run_coroutine_threadsafe(self._follow(session_id, streamed), self.loop))
        return streamed

    def wait(self, session_id: str, timeout: float) -> Streamed:
        """The session's client once it got ``done`` (or after ``timeout`` seconds, as it is)."""
        streamed = self.streams[session_id]
        streamed.ended.wait(timeout)
        return streamed

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    @staticmethod
    async def _follow(session_id: str, streamed: Streamed) -> None:
        from sessions.streams.follow import follow
        from sessions.streams.token_stream import IDLE_LIMIT, StreamEntry

        after = "0-0"
        try:
            while True:
                try:
                    async with aclosing(follow(session_id, after, idle_limit_s=IDLE_LIMIT_S)) as items:
                        async for item in items:
                            if item == IDLE_LIMIT or not isinstance(item, StreamEntry):
                                continue  # a heartbeat; after the idle limit the stream ends: open it again
                            after = item.id or after  # a done made from the ended row has no id
                            if item.event == "tokens":
                                streamed.steps.append((item.data["step"], list(item.data["token_ids"])))
                            elif item.event == "done":
                                streamed.done = item.data
                                return
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001  (a service restarting under the client: open it again)
                    pass
                streamed.reopened += 1
                await asyncio.sleep(RECONNECT_S)
        finally:
            streamed.ended.set()
