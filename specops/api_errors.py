"""One error shape for the API: ``{"errors": {field: [rule, ...]}, "detail": ...}``."""
from __future__ import annotations

from rest_framework.views import exception_handler as drf_exception_handler


def exception_handler(exc, context):
    """Keep DRF's per-field messages (they name the field and the rule) and add ``status``."""
    response = drf_exception_handler(exc, context)
    if response is not None and isinstance(response.data, dict):
        response.data.setdefault("status", response.status_code)
    return response
