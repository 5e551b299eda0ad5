"""One error shape for the API: DRF's body plus the HTTP status.

A validation error is ``{field: [rule, ...], "status": 400}`` (each message names the field
and the rule); any other error is ``{"detail": message, "status": code}``. A body that DRF
gives as a list (a ``ValidationError`` raised with a list, not a dict) is left as it is.
"""
from __future__ import annotations

from rest_framework.exceptions import APIException
from rest_framework.views import exception_handler as drf_exception_handler


def exception_handler(exc, context):
    """Keep DRF's per-field messages and add ``status``, so a client need not read the status line."""
    response = drf_exception_handler(exc, context)
    if response is not None and isinstance(response.data, dict):
        response.data.setdefault("status", response.status_code)
    return response


class Conflict(APIException):
    """409: the request is valid but the resource's state refuses it (``detail`` says which state)."""

    status_code = 409
    default_detail = "the resource's current state does not allow this."
    default_code = "conflict"


class Gone(APIException):
    """410: the resource existed and was moved out of the database (an archived session's day)."""

    status_code = 410
    default_detail = "the resource is no longer in the database."
    default_code = "gone"


class Unavailable(APIException):
    """503: something the request needs is not ready or not reachable (a model still being built,
    the task queue); with ``retry_after_s``, ``Retry-After`` says when to ask again.

    DRF's handler sets the header from ``wait`` (as for a throttled request).
    """

    status_code = 503
    default_detail = "the service is unavailable; try again shortly."
    default_code = "unavailable"

    def __init__(self, detail: str, code: str, retry_after_s: int | None = None) -> None:
        super().__init__(detail, code)
        self.wait = retry_after_s
