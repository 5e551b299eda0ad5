"""Which tenant a request acts for. Every API queryset is filtered by it."""
from __future__ import annotations

from metadata.models import Tenant


def tenant_of(user) -> Tenant | None:
    membership = getattr(user, "membership", None) if user is not None else None
    return membership.tenant if membership is not None else None
