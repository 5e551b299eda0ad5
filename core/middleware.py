"""Refuse a request body over DATA_UPLOAD_MAX_MEMORY_SIZE with a JSON 413 that names the limit.

Django checks that limit only when ``request.body`` is read, and DRF's JSON parser reads the
stream instead, so without this a 10 MB body was parsed in full. Checked on ``Content-Length``
before any view runs; multipart bodies are left to Django's own parser, whose limit excludes
uploaded files. Runs natively under ASGI and WSGI (no thread hop for the async views).
"""
from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse

from core.error_views import body_too_large_message, error_response


def body_too_large(request: HttpRequest) -> HttpResponse | None:
    """The 413 answer to ``request``, or None when its declared body is within the limit."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if limit is None or request.content_type == "multipart/form-data":
        return None
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return None  # Django answers a malformed length itself
    if length <= limit:
        return None
    return error_response(request, 413, body_too_large_message(length), code="request_too_large")


class BodySizeLimitMiddleware:
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
        return body_too_large(request) or self.get_response(request)

    async def _acall(self, request: HttpRequest):
        return body_too_large(request) or await self.get_response(request)
