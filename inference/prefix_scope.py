"""Whose cached prefixes a session may adopt: its tenant's, or its tenant group's.

The prefix cache is a side channel: a hit (``cached_tokens``, a sooner first token) tells the
caller, in whole blocks, that someone sent that prefix before. So the tenant is its trust
boundary: the worker passes this scope to the engine as the request's ``cache_scope`` (rows of
different scopes never share blocks, inference/engine/batch/prefix_reuse.py) and conversation
affinity keys its records by it (inference/affinity.py). Tenants an operator puts in one
``prefix_cache_group`` (admin, Tenants) share one scope.
"""
from __future__ import annotations

from metadata.models import Session, Tenant
from metadata.models.tenants import prefix_cache_scope


def session_cache_scope(session: Session) -> str:
    """The scope of ``session``'s tenant, read now (one indexed read: an operator's change of
    group applies from the next session on)."""
    group = Tenant.objects.filter(pk=session.tenant_id).values_list("prefix_cache_group", flat=True).first()
    return prefix_cache_scope(session.tenant_id, group or "")
