"""Errors of the /v1/ API, in OpenAI's shape (``core.error_views.openai_error_body``).

Clients of the OpenAI protocol read ``error.message`` and branch on the HTTP status and
``error.code``; ``param`` names the request field at fault (None when no field is).
"""
from __future__ import annotations

from typing import Any

from django.http import JsonResponse

from core.error_views import openai_error_body


class OpenAIError(Exception):
    """An error answer of the /v1/ API; raise it anywhere in a request, the view renders it."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.error_type, self.headers = error_type, headers or {}

    def body(self) -> dict[str, Any]:
        return openai_error_body(self.status, self.message, param=self.param, code=self.code, error_type=self.error_type)

    def response(self) -> JsonResponse:
        response = JsonResponse(self.body(), status=self.status)
        for name, value in self.headers.items():
            response[name] = value
        return response


def bad_param(param: str | None, message: str, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def unsupported(param: str, what: str = "") -> OpenAIError:
    detail = f" ({what})" if what else ""
    return OpenAIError(400, f"'{param}' is not supported by this server{detail}.", param=param,
                       code="unsupported_parameter")
