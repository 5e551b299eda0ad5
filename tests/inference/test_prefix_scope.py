"""The prefix cache's scope: a tenant's own, or its operator-made group's; no setting shares it
across every tenant, and a deployment that still asks for that is told so by a system check."""
from __future__ import annotations

import pytest

from inference.prefix_scope import session_cache_scope
from metadata.models import Session, Tenant
from tests.core.test_configuration import manage


def test_a_leftover_shared_isolation_is_a_system_check_error_that_says_what_to_do_instead():
    result = manage("check", SPECOPS_PREFIX_CACHE_ISOLATION="shared")
    assert result.returncode != 0
    assert "specops.E005" in result.stderr and "prefix_cache_group" in result.stderr
    assert manage("check", SPECOPS_PREFIX_CACHE_ISOLATION="tenant").returncode == 0


@pytest.mark.django_db
def test_a_sessions_scope_is_its_tenants_or_its_groups_read_when_the_run_starts():
    alone, partner_1, partner_2 = (Tenant.objects.create(name=name) for name in ("alone", "partner-1", "partner-2"))
    Tenant.objects.filter(pk__in=[partner_1.pk, partner_2.pk]).update(prefix_cache_group="partners")
    scopes = {tenant.name: session_cache_scope(Session(tenant_id=tenant.pk)) for tenant in (alone, partner_1, partner_2)}
    assert scopes == {"alone": f"tenant:{alone.pk}", "partner-1": "group:partners", "partner-2": "group:partners"}
    assert alone.prefix_cache_scope() == scopes["alone"]
