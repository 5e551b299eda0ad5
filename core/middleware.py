"""Refuse, before any view or query runs, what no view can answer well.

A request body over DATA_UPLOAD_MAX_MEMORY_SIZE is a JSON 413 that names the limit: Django checks
that limit only when ``request.body`` is read, and DRF's JSON parser reads the stream instead, so
without this a 10 MB body was parsed in full. Checked on ``Content-Length``, for every content
type: Django's own limit excludes a multipart body's files, which it spools to disk, and the API
takes none. Under ASGI the handler has spooled the body before any middleware runs:
``core.body_limit`` refuses it earlier, unread, and bounds an unauthenticated body far lower.

A NUL character in the path or the query string (``%00``) reaches no query: PostgreSQL text
cannot hold it, and the request log, a lookup by name or a cursor would fail with a 500. A path
with one names nothing (404); a query parameter with one is a 400 naming the parameter and the
rule. (Lone surrogates cannot come from a URL: Django decodes it with replacement characters.)
Runs first, natively under ASGI and WSGI (no thread hop for the async views).
"""
from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse

from core.error_views import (
    body_too_large_message,
    error_response,
    field_error_response,
)
from core.parsers import text_rule_broken


def body_too_large(request: HttpRequest) -> HttpResponse | None:
    """The 413 answer to ``request``, or None when its declared body is within the limit."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if limit is None:
        return None
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return None  # Django answers a malformed length itself
    if length <= limit:
        return None
    return error_response(request, 413, body_too_large_message(length), code="request_too_large")


def unsafe_url(request: HttpRequest) -> HttpResponse | None:
    """404 for a path no query can look up, 400 naming a query parameter that breaks a text rule."""
    if text_rule_broken(request.path):
        return error_response(request, 404, "no resource at this path (it contains a NUL character).",
                              code="not_found")
    for name, values in request.GET.lists():
        rule = text_rule_broken(name)
        if rule:
            return field_error_response(request, None, f"a query parameter's name {rule}.")
        for value in values:
            rule = text_rule_broken(value)
            if rule:
                return field_error_response(request, name, f"query parameter '{name}' {rule}.")
    return None


def refused(request: HttpRequest) -> HttpResponse | None:
    return body_too_large(request) or unsafe_url(request)


class BodySizeLimitMiddleware:
    """The body limit and the URL's text rules (the module's docstring says why)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):
        if self.is_async:
            return self._acall(request)
        return refused(request) or self.get_response(request)

    async def _acall(self, request: HttpRequest):
        return refused(request) or await self.get_response(request)
