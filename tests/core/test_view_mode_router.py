"""Sync views through Django's WSGI handler in one thread hop, async views through its ASGI handler
(``core.view_mode_router``), driven in-process through the real ASGI application."""
from __future__ import annotations

import asyncio
import io
import json
import threading

import pytest
from django.http import StreamingHttpResponse
from rest_framework.authtoken.models import Token

from core.view_mode_router import ViewModeRouter, is_async_view, wsgi_environ


def call(app, method: str, path: str, chunks: list[bytes], headers: list[tuple[bytes, bytes]]):
    """One ASGI HTTP request, its body in ``chunks`` (several: as a chunked upload arrives)."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), *headers], "client": ("127.0.0.1", 5000),
             "server": ("127.0.0.1", 8000)}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body


def test_rest_views_and_the_session_stream_are_sync_and_the_openai_protocol_async():
    assert not is_async_view("/api/v1/sessions/")
    assert not is_async_view("/api/v1/generations/")
    assert not is_async_view("/no/such/page/")  # Django's 404, either way
    assert not is_async_view("/api/v1/sessions/01a23caa-bf86-7bc9-9bba-13cd6269ce31/stream/")  # an async body
    assert is_async_view("/v1/chat/completions")


def test_environ_joins_repeated_headers_and_counts_the_body_read():
    scope = {"method": "POST", "path": "/api/v1/x/", "query_string": b"a=1", "headers": [
        (b"content-type", b"application/json"), (b"x-forwarded-for", b"10.0.0.1"),
        (b"x-forwarded-for", b"10.0.0.2")], "client": ("127.0.0.9", 4000), "server": ("testserver", 80)}
    environ = wsgi_environ(scope, io.BytesIO(b"{}"), 2)
    assert environ["CONTENT_TYPE"] == "application/json" and environ["CONTENT_LENGTH"] == "2"
    assert environ["HTTP_X_FORWARDED_FOR"] == "10.0.0.1,10.0.0.2"
    assert environ["REMOTE_ADDR"] == "127.0.0.9" and environ["QUERY_STRING"] == "a=1"


# the pool's threads read through connections of their own, where the router sends them
@pytest.mark.django_db(transaction=True, databases="__all__")
def test_a_sync_view_gets_a_chunked_body_whole_and_answers_as_under_asgi(api_user, tiny_model):
    from specops.asgi import application

    token = Token.objects.create(user=api_user).key
    headers = [(b"authorization", f"Token {token}".encode()), (b"content-type", b"application/json")]
    body = json.dumps({"prompt": "import os\n", "max_new_tokens": 4, "temperature": 99.0}).encode()

    status, response_headers, content = call(application, "POST", "/api/v1/generations/",
                                             [body[:10], body[10:]], headers)  # no Content-Length

    assert status == 400, content  # the whole body was parsed: the error names the field
    assert "temperature" in json.loads(content)
    assert response_headers[b"content-type"] == b"application/json"

    status, _, content = call(application, "GET", "/api/v1/sessions/", [b""], headers)
    assert status == 200 and json.loads(content)["results"] == []


@pytest.mark.django_db(transaction=True)
def test_requests_for_async_views_go_to_the_asgi_handler(api_user):
    seen = []

    async def asgi_app(scope, receive, send):
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def wsgi_app(environ, start_response):
        seen.append("wsgi " + environ["PATH_INFO"])
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"sync"]

    router = ViewModeRouter(asgi_app, wsgi_app, threads=1)
    assert call(router, "GET", "/v1/models", [b""], [])[0] == 204
    assert call(router, "GET", "/api/v1/sessions/", [b""], []) == (200, {b"content-type": b"text/plain"}, b"sync")
    assert seen == ["/v1/models", "wsgi /api/v1/sessions/"]


def test_an_async_body_is_sent_from_the_loop_until_the_client_leaves_then_closed():
    """A sync view's streaming response with an async body (the session stream): the request's
    sync part ends in the pool thread (its ``close``), the loop sends each part, and when the
    client disconnects the body is cancelled and closed (its ``finally`` runs: a stream's slot)."""
    events: list[str] = []
    threads: dict[str, str] = {}

    async def body():
        threads["body"] = threading.current_thread().name
        try:
            for number in range(3):
                yield f"part {number}\n"
            await asyncio.sleep(3600)  # open, as a stream waiting for its next event
        finally:
            events.append("body closed")

    def wsgi_app(environ, start_response):
        threads["view"] = threading.current_thread().name
        response = StreamingHttpResponse(body(), content_type="text/event-stream")
        response.close = lambda: events.append("request finished")
        start_response("200 OK", [("Content-Type", "text/event-stream")])
        return response

    sent: list[dict] = []
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        while sum(1 for m in sent if m.get("body")) < 3:
            await asyncio.sleep(0.01)
        events.append("client left")
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/api/v1/sessions/", "query_string": b"", "headers": []}
    router = ViewModeRouter(None, wsgi_app, threads=1)
    asyncio.run(asyncio.wait_for(router(scope, receive, send), 10))

    assert sent[0] == {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    assert [m["body"] for m in sent[1:]] == [b"part 0\n", b"part 1\n", b"part 2\n"]
    assert events == ["request finished", "client left", "body closed"]
    assert threads["view"].startswith("specops-sync") and threads["body"] == "MainThread"


def test_an_async_body_that_ends_ends_the_response():
    async def body():
        yield "event: done\n\n"

    def wsgi_app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/event-stream")])
        return StreamingHttpResponse(body(), content_type="text/event-stream")

    status, _, content = call(ViewModeRouter(None, wsgi_app, threads=1), "GET", "/api/v1/sessions/", [b""], [])
    assert (status, content) == (200, b"event: done\n\n")
