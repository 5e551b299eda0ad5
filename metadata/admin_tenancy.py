"""The admin's rows of tenant data restricted to the tenant a staff member belongs to.

Staff status lets someone into the admin; it is not a view of every tenant's prompts and outputs.
A superuser sees every tenant; a staff member sees the rows of their own tenant
(``TenantMembership``) and nothing of a tenant they do not belong to, not even by id (the change
page of another tenant's session is as absent as a missing one); staff in no tenant see none.
Rows are restricted once, in ``get_queryset`` (NetBox's ``.restrict()``), so lists, change pages,
actions and the admin's own views all go through it.
"""
from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet

from metadata.models import Tenant


def tenant_ids_of(user: Any) -> list[int] | None:
    """The tenants ``user`` may see in the admin: None for all (a superuser), else a list (maybe empty)."""
    if getattr(user, "is_superuser", False):
        return None
    membership = getattr(user, "membership", None)  # one tenant per user (the reverse one-to-one)
    return [membership.tenant_id] if membership is not None else []


def restrict(queryset: QuerySet, user: Any, tenant_field: str = "tenant") -> QuerySet:
    """``queryset`` narrowed to the rows of the tenants ``user`` may see."""
    tenants = tenant_ids_of(user)
    if tenants is None:
        return queryset
    return queryset.filter(**{f"{tenant_field}__in": tenants}) if tenants else queryset.none()


class TenantScopedAdmin(admin.ModelAdmin):
    """A model admin whose rows are restricted to the staff member's tenant (``tenant_field``)."""

    tenant_field = "tenant"

    def get_queryset(self, request) -> QuerySet:
        return restrict(super().get_queryset(request), request.user, self.tenant_field)

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        """A tenant chosen in a form is one of the staff member's own."""
        if db_field.related_model is Tenant:
            kwargs["queryset"] = restrict(Tenant.objects.all(), request.user, "pk")
        return super().formfield_for_foreignkey(db_field, request, **kwargs)
