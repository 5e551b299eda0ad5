"""What every API over the store shares: who calls, for which tenant, and keyset pages of its tables.

``authentication`` (API tokens, their user, membership and tenant through the two-tier cache),
``credentials`` (whether a request's headers carry valid credentials, before its body is read),
``async_views`` (the same checks for plain async views, and ``run_db``), ``tenancy``
(``tenant_of``: the tenant a request acts for), ``pagination`` (``KeysetPagination`` and its
column spec ``KeyColumn``: keyset pages with opaque cursors, correct for mixed ASC/DESC
orderings; the concrete ``SessionPagination`` / ``TokenPagination`` / ``CandidatePagination``).
The endpoints are the apps' above: ``sessions.api`` and ``inference.api``.

Importing this package loads nothing: the names below load DRF and the models on first use.
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
