"""Refuse a request body over the limit before Django reads it (an ASGI wrapper of the application).

Under ASGI, Django's handler reads the whole body into a spooled file (memory, then disk)
before any middleware runs, so ``core.middleware``'s check of ``Content-Length`` came after a
10 GB body had been written to disk, and a chunked body (no ``Content-Length``) was not checked
at all. ``BodyLimit`` wraps the ASGI application: a declared ``Content-Length`` over
``DATA_UPLOAD_MAX_MEMORY_SIZE`` is a 413 before a byte of the body is read; a body that streams
in without one is counted as it arrives and cut off with the same 413 at the first chunk past
the limit. The 413 is JSON in the called API's shape and names the limit (``core.error_views``).
Multipart bodies are left to Django, as in ``core.middleware``: that limit excludes uploaded files.
"""
from __future__ import annotations

import json
from typing import Any

from django.conf import settings

from core.error_views import body_too_large_message, is_openai_path, openai_error_body

Scope = dict[str, Any]


class BodyTooLarge(Exception):
    """Raised from ``receive`` when a streamed body passes the limit (caught by ``BodyLimit``)."""


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # Django answers a malformed length itself
    return None


def is_multipart(scope: Scope) -> bool:
    return any(name.lower() == b"content-type" and value.lower().startswith(b"multipart/form-data")
               for name, value in scope.get("headers", ()))


def too_large_body(path: str, length: int | None) -> bytes:
    message = body_too_large_message(length)
    if is_openai_path(path):
        body = openai_error_body(413, message, code="request_too_large")
    else:
        body = {"detail": message, "status": 413}
    return json.dumps(body).encode()


class BodyLimit:
    """The ASGI application, with bodies over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` refused (the module
    docstring says why and how)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive, send) -> None:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if scope["type"] != "http" or limit is None or is_multipart(scope):
            await self.app(scope, receive, send)
            return
        length = declared_length(scope)
        if length is not None and length > limit:
            await self.refuse(scope, send, length)  # nothing of the body is read
            return
        received = 0

        async def counted_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge
            return message

        try:
            await self.app(scope, counted_receive, send)
        except BodyTooLarge:  # raised while Django reads the body: no response has started
            await self.refuse(scope, send, None)

    @staticmethod
    async def refuse(scope: Scope, send, length: int | None) -> None:
        body = too_large_body(scope.get("path", ""), length)
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
