"""The metadata store's REST API: sessions, their tokens and candidates, scoped to the tenant.

``urls`` (mounted by ``specops/urls.py`` with ``include("metadata.api.urls")``) routes to the
viewsets in ``views``, which render with ``serializers``. Shared with the inference API:
``KeysetPagination`` and its column spec ``KeyColumn`` (keyset pages with opaque cursors, correct
for mixed ASC/DESC orderings), the concrete ``SessionPagination`` / ``TokenPagination`` /
``CandidatePagination``, and ``tenant_of`` (the tenant a request acts for).

Importing this package loads nothing: the names below load DRF and the models on first use, and
views, serializers and urls are reached by their module path.
"""
from __future__ import annotations

from typing import Any

__all__ = [
    "CandidatePagination", "KeyColumn", "KeysetPagination", "SessionPagination", "TokenPagination",
    "after_predicate", "decode_cursor", "encode_cursor", "tenant_of",
]

_FROM_PAGINATION = frozenset({"CandidatePagination", "KeyColumn", "KeysetPagination", "SessionPagination",
                              "TokenPagination", "after_predicate", "decode_cursor", "encode_cursor"})


def __getattr__(name: str) -> Any:
    if name in _FROM_PAGINATION:
        from metadata.api import pagination

        return getattr(pagination, name)
    if name == "tenant_of":
        from metadata.api.tenancy import tenant_of

        return tenant_of
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
