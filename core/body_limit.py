"""Refuse a request body over its limit before Django reads it (an ASGI wrapper of the application).

Under ASGI, Django's handler (and ``core.view_mode_router`` for the sync views) reads the whole
body into a spooled file (memory, then disk) before any middleware or authentication runs, so
a limit checked there comes after a 10 GB body was written to disk. ``BodyLimit`` wraps the
ASGI application and holds two limits, for every content type (multipart included: the API
takes no uploads, and an exemption for them let a 300 MB form be spooled before its 401):

- ``DATA_UPLOAD_MAX_MEMORY_SIZE`` for every request: a declared ``Content-Length`` over it is a
  413 before a byte of the body is read; a body that streams in without one is counted as it
  arrives and cut off with the same 413 at the first chunk past the limit.
- ``PREAUTH_BODY_LIMIT`` (64 KiB) for a request without valid credentials: past that bound the
  body is read only once ``credentials_valid`` (the API token of ``Authorization``, or the
  admin's session cookie, checked by the caller's function: this floor knows no tokens) says
  the request carries them. A declared length over the bound is checked before anything is
  read; a streamed body when it reaches the bound with more to come. So an anonymous client can
  make the application read at most 64 KiB, however large a body it declares or sends.

The 413 is JSON in the called API's shape and names the limit (``core.error_views``).
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from django.conf import settings

from core.error_views import body_too_large_message, is_openai_path, openai_error_body

Scope = dict[str, Any]
CredentialsCheck = Callable[[Scope], Awaitable[bool]]

PREAUTH_BODY_LIMIT = 65_536


class BodyTooLarge(Exception):
    """Raised from ``receive`` when a streamed body passes a limit (caught by ``BodyLimit``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # Django answers a malformed length itself
    return None


def preauth_message(length: int | None) -> str:
    size = f"is {length} bytes" if length is not None else "is larger than that"
    return (f"request body {size}; a request without valid credentials may send at most "
            f"{preauth_limit()} bytes (send 'Authorization: Token <token>', or sign in to the admin).")


def preauth_limit() -> int:
    """The bound on an unauthenticated body: never above the limit of every body."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return PREAUTH_BODY_LIMIT if limit is None else min(PREAUTH_BODY_LIMIT, limit)


def error_body(path: str, message: str) -> bytes:
    if is_openai_path(path):
        body = openai_error_body(413, message, code="request_too_large")
    else:
        body = {"detail": message, "status": 413}
    return json.dumps(body).encode()


async def no_credentials(scope: Scope) -> bool:
    """The check when none is given: no request is trusted with more than the pre-auth bound."""
    return False


class BodyLimit:
    """The ASGI application, with bodies over their limit refused unread (the module docstring
    says which and why). ``credentials_valid(scope)`` says whether a request carries valid
    credentials; it is asked at most once per request, only for a body past the pre-auth bound."""

    def __init__(self, app, credentials_valid: CredentialsCheck = no_credentials) -> None:
        self.app = app
        self.credentials_valid = credentials_valid

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        preauth = preauth_limit()
        length = declared_length(scope)
        if limit is not None and length is not None and length > limit:
            await self.refuse(scope, send, body_too_large_message(length))  # nothing of the body is read
            return
        trusted: bool | None = None  # not asked yet
        if length is not None and length > preauth:
            trusted = await self.credentials_valid(scope)
            if not trusted:
                await self.refuse(scope, send, preauth_message(length))
                return
        received = 0

        async def counted_receive() -> dict:
            nonlocal received, trusted
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if limit is not None and received > limit:
                    raise BodyTooLarge(body_too_large_message(None))
                # at the bound with more to come is past it: the app never reads beyond the bound
                past = received > preauth or (received == preauth and message.get("more_body", False))
                if past and not trusted:
                    if trusted is None:
                        trusted = await self.credentials_valid(scope)
                    if not trusted:
                        raise BodyTooLarge(preauth_message(None))
            return message

        try:
            await self.app(scope, counted_receive, send)
        except BodyTooLarge as exc:  # raised while the body is read: no response has started
            await self.refuse(scope, send, exc.message)

    @staticmethod
    async def refuse(scope: Scope, send, message: str) -> None:
        body = error_body(scope.get("path", ""), message)
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
