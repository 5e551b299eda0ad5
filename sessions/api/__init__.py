"""The sessions' REST API (``/api/v1/sessions/``): a tenant's sessions, their tokens, candidates and stream.

``urls`` (mounted by ``specops/urls.py`` with ``include("sessions.api.urls")``) routes to the
viewset and the stream view in ``views``, which render with ``serializers``. Shared with the
OpenAI protocol: ``public_error``, what a tenant is told of a session's stored error.

Importing this package loads nothing: ``public_error`` loads DRF and the models on first use, and
views, serializers and urls are reached by their module path.
"""
from __future__ import annotations

from typing import Any

__all__ = ["public_error"]


def __getattr__(name: str) -> Any:
    if name == "public_error":
        from sessions.api.serializers import public_error

        return public_error
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
