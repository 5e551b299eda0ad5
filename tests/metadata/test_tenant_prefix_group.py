"""An operator groups tenants for the prefix cache in the admin (Tenants): the group is a slug,
and tenants left without one share nothing."""
from __future__ import annotations

import pytest

from metadata.models import Tenant

pytestmark = pytest.mark.django_db


def change(admin_client, tenant: Tenant, group: str):
    return admin_client.post(f"/admin/metadata/tenant/{tenant.pk}/change/", {
        "name": tenant.name, "max_live_generations": "", "max_open_streams": "", "prefix_cache_group": group,
        "created_at_0": tenant.created_at.strftime("%Y-%m-%d"), "created_at_1": tenant.created_at.strftime("%H:%M:%S")})


def test_the_admin_sets_a_tenants_prefix_cache_group_and_refuses_one_that_is_not_a_slug(admin_client):
    tenant = Tenant.objects.create(name="grouped")
    assert tenant.prefix_cache_scope() == f"tenant:{tenant.pk}"
    page = admin_client.get(f"/admin/metadata/tenant/{tenant.pk}/change/")
    assert b"prefix_cache_group" in page.content
    assert change(admin_client, tenant, "partners").status_code == 302
    tenant.refresh_from_db()
    assert tenant.prefix_cache_scope() == "group:partners"
    refused = change(admin_client, tenant, "two words")
    assert refused.status_code == 200 and b"errorlist" in refused.content
    tenant.refresh_from_db()
    assert tenant.prefix_cache_group == "partners"
