"""Errors as JSON in the shape of the API that was called, never a traceback or a settings dump.

``/v1/`` (the OpenAI protocol) answers ``{"error": {"message", "type", "param", "code"}}``
(``param`` names the request field at fault, None when no field is);
everything else answers SpecOps's ``{"detail": message, "status": code}`` (core.api_errors).
``specops/urls.py`` installs the handlers; the 413 middleware and the plain async views use
``error_response`` too.
"""
from __future__ import annotations

import logging

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, JsonResponse

logger = logging.getLogger(__name__)

OPENAI_PATH_PREFIX = "/v1/"
OPENAI_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
    404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
    429: "requests",
}


def openai_error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
                      error_type: str | None = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type or OPENAI_TYPE_BY_STATUS.get(status, "server_error"),
                      "param": param, "code": code}}


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PATH_PREFIX)


def error_response(request: HttpRequest, status: int, message: str, *, param: str | None = None,
                   code: str | None = None, error_type: str | None = None,
                   headers: dict[str, str] | None = None) -> JsonResponse:
    """A JSON error in the called API's shape."""
    if is_openai_path(request.path):
        body = openai_error_body(status, message, param=param, code=code, error_type=error_type)
    else:
        body = {"detail": message, "status": status}
    response = JsonResponse(body, status=status)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def field_error_response(request: HttpRequest, param: str | None, message: str) -> JsonResponse:
    """A 400 for one request field in the called API's shape: OpenAI's ``param``, or DRF's
    ``{field: [message], "status": 400}`` (``detail`` when no field is at fault)."""
    if is_openai_path(request.path) or param is None:
        return error_response(request, 400, message, param=param, code="invalid_value")
    return JsonResponse({param: [message], "status": 400}, status=400)


def body_too_large_message(length: int | None) -> str:
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    size = f"{length} bytes" if length is not None else "larger than allowed"
    return f"request body is {size}; the limit is {limit} bytes (DATA_UPLOAD_MAX_MEMORY_SIZE)."


def bad_request(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    if isinstance(exception, RequestDataTooBig):
        return error_response(request, 413, body_too_large_message(None), code="request_too_large")
    return error_response(request, 400, "bad request.")


def permission_denied(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return error_response(request, 403, "you do not have permission to perform this action.",
                          code="permission_denied")


def page_not_found(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return error_response(request, 404, f"no resource at {request.path[:200]}.", code="not_found")


def server_error(request: HttpRequest) -> JsonResponse:
    """Django has logged the exception (``django.request``); the client learns nothing more."""
    return error_response(request, 500, "internal server error; the failure has been logged.",
                          code="internal_error")
