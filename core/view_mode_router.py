"""Serve each request by the handler that suits its view: sync views in one thread hop, async views on the loop.

Under Django's ASGI handler a sync view (the DRF API, the admin) pays for the async plumbing on
every request: each request gets a new thread (``ThreadSensitiveContext``), the sync middleware
chain hops to it, hops back to the loop for the innermost async handler (and twice more for the
Prometheus "after" middleware, a ``MiddlewareMixin`` in async mode), then hops again to run the
view; the request signals hop as well. Profiled in-process (bench/README.md, "Load test"), that
plumbing was a fifth of the web tier's CPU per request on the 2-core machine, which the load
test saturates.

``ViewModeRouter`` resolves the path once: a request for a sync view (or for no view: the 404 is
Django's either way) runs through Django's WSGI handler in one call on a bounded thread pool
(the same middleware, the same settings, the request signals on that thread, so its database
connections go back to the pool when it ends); a request for an async view (the OpenAI
protocol) goes to the ASGI handler as before. A sync view may answer with an async body (the
session stream, ``AsyncBody``): its checks run in the one hop, and the loop sends the body,
holding no thread (under the ASGI handler, the sync middleware alone hopped a dozen times per
stream opened, each hop a wait for the GIL on a busy process). The pool has as many threads as a
database alias's connection pool has connections, so a burst waits for a thread here instead
of timing out on the pool (a 500). Hand-written rather than a WSGI-in-ASGI library (asgiref's
``WsgiToAsgi``, a2wsgi): those hop back to the loop for every message they send, which is the
cost this module removes; a whole non-streaming response is sent from the loop once the
thread returns it.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
from concurrent.futures import ThreadPoolExecutor
from tempfile import SpooledTemporaryFile
from typing import Any, Callable

from asgiref.sync import iscoroutinefunction
from django.conf import settings
from django.urls import Resolver404, get_resolver

Scope = dict[str, Any]
WSGIApp = Callable[[dict[str, Any], Callable], Any]


def pool_size() -> int:
    """Threads for the sync views: the primary's connection pool size (8 when it is unpooled)."""
    pool = settings.DATABASES["default"].get("OPTIONS", {}).get("pool")
    return int(pool.get("max_size", 8)) if isinstance(pool, dict) else 8


def is_async_view(path: str) -> bool:
    """Whether the view at ``path`` is a coroutine function (no view: False)."""
    return _is_async_view(settings.ROOT_URLCONF, path)


@functools.lru_cache(maxsize=4096)  # a crowd polls the same few session paths; resolving costs ~0.1 ms
def _is_async_view(urlconf: str, path: str) -> bool:
    try:
        match = get_resolver(urlconf).resolve(path)
    except Resolver404:
        return False
    return iscoroutinefunction(match.func)


def wsgi_environ(scope: Scope, body, length: int) -> dict[str, Any]:
    """The PEP 3333 environ of an ASGI HTTP scope whose whole body (``length`` bytes) is in ``body``.

    ``CONTENT_LENGTH`` is the length read, so a chunked body (no header) reaches Django too, as
    it does under the ASGI handler.
    """
    root = scope.get("root_path", "")
    path = scope["path"]
    if root and path.startswith(root):
        path = path[len(root):]
    server = scope.get("server") or ("localhost", 80)
    environ: dict[str, Any] = {
        "REQUEST_METHOD": scope["method"],
        "SCRIPT_NAME": root.encode("utf8").decode("latin1"),
        "PATH_INFO": path.encode("utf8").decode("latin1"),
        "QUERY_STRING": scope.get("query_string", b"").decode("latin1"),
        "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
        "SERVER_NAME": str(server[0]),
        "SERVER_PORT": str(server[1] or 0),
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": body,
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    client = scope.get("client")
    if client:
        environ["REMOTE_ADDR"], environ["REMOTE_PORT"] = client[0], str(client[1])
    for raw_name, raw_value in scope.get("headers", ()):
        name = raw_name.decode("latin1").upper().replace("-", "_")
        if name not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            name = f"HTTP_{name}"
        value = raw_value.decode("latin1")
        environ[name] = f"{environ[name]},{value}" if name in environ else value
    environ["CONTENT_LENGTH"] = str(length)
    return environ


class _Started:
    """What the WSGI application passed to ``start_response``, as ASGI wants it."""

    __slots__ = ("headers", "status")

    def __init__(self) -> None:
        self.status = 500
        self.headers: list[tuple[bytes, bytes]] = []

    def __call__(self, status: str, headers: list[tuple[str, str]], exc_info=None):
        self.status = int(status.split(" ", 1)[0])
        self.headers = [(name.lower().encode("latin1"), value.encode("latin1")) for name, value in headers]
        return self._no_write

    @staticmethod
    def _no_write(data: bytes) -> None:
        raise NotImplementedError("Django's WSGI handler returns its body; write() is not used")


class AsyncBody:
    """A response whose body is an async iterator of bytes, sent from the event loop.

    As Django's ASGI handler sends one: the body until it ends or the client disconnects (then
    the iterator is cancelled and closed, so a stream's ``finally`` gives its slot back).
    """

    def __init__(self, started: _Started, content) -> None:
        self.started, self.content = started, content

    async def send(self, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.started.status, "headers": self.started.headers})
        sending = asyncio.create_task(self._send_body(send))
        listening = asyncio.create_task(_disconnect(receive))
        try:
            await asyncio.wait((sending, listening), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (listening, sending):
                if not task.done():
                    task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass  # the client left (the body), or the body ended (the listener)

    async def _send_body(self, send) -> None:
        async with contextlib.aclosing(self.content) as content:
            async for chunk in content:
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


async def _disconnect(receive) -> None:
    """Return when the client disconnects (nothing else arrives once the body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ViewModeRouter:
    """An ASGI application: sync views through ``wsgi_app`` on a thread pool, the rest through ``asgi_app``."""

    def __init__(self, asgi_app, wsgi_app: WSGIApp, threads: int | None = None) -> None:
        self.asgi_app = asgi_app
        self.wsgi_app = wsgi_app
        self.executor = ThreadPoolExecutor(max_workers=threads or pool_size(), thread_name_prefix="specops-sync")

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http" or is_async_view(scope["path"]):
            await self.asgi_app(scope, receive, send)
            return
        max_in_memory = settings.FILE_UPLOAD_MAX_MEMORY_SIZE
        with SpooledTemporaryFile(max_size=max_in_memory) as body:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client left before its request was whole: nothing to answer
                body.write(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            length = body.tell()
            body.seek(0)
            environ = wsgi_environ(scope, body, length)
            loop = asyncio.get_running_loop()
            whole = await loop.run_in_executor(self.executor, self._run, environ, loop, send)
        if isinstance(whole, AsyncBody):
            await whole.send(receive, send)
            return
        if whole is not None:
            started, content = whole
            await send({"type": "http.response.start", "status": started.status, "headers": started.headers})
            await send({"type": "http.response.body", "body": content})

    def _run(self, environ: dict[str, Any], loop: asyncio.AbstractEventLoop, send):
        """Run the WSGI application on this pool thread: ``(status and headers, body)`` of a plain
        response, for the loop to send; a streaming response is sent from here chunk by chunk
        (None), so the thread that owns the request's database connections also closes it."""
        started = _Started()
        response = self.wsgi_app(environ, started)
        if getattr(response, "streaming", False) and getattr(response, "is_async", False):
            # An async body (an SSE stream): the loop sends it, holding no thread. The request's
            # sync part (middleware, authentication, the view's checks) ends here, and with it
            # the request: request_finished gives this thread's connections back to the pool
            # (the body reads through run_db, which releases its own).
            body = AsyncBody(started, response.streaming_content)
            response.close()
            return body
        try:
            if not getattr(response, "streaming", False):
                return started, b"".join(response)

            def put(message: dict[str, Any]) -> None:
                asyncio.run_coroutine_threadsafe(send(message), loop).result()

            put({"type": "http.response.start", "status": started.status, "headers": started.headers})
            for chunk in response:
                if chunk:
                    put({"type": "http.response.body", "body": chunk, "more_body": True})
            put({"type": "http.response.body", "body": b""})
            return None
        finally:
            close = getattr(response, "close", None)
            if close is not None:
                close()  # request_finished: this thread's database connections go back to the pool
