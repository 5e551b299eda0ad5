"""manage.py loadtest_tenants: one tenant, API user and token per simulated client of a load-test
run, and their removal (deploy/loadtest/run.sh calls it around the run)."""
from __future__ import annotations

import stat

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from metadata.models import Session, Tenant, TenantMembership

pytestmark = pytest.mark.django_db


def client_with(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


def test_each_client_gets_its_own_tenant_and_token_and_the_run_removes_them(tmp_path, tiny_model):
    out = tmp_path / "tokens"
    call_command("loadtest_tenants", "create", "--run", "r1", "--count", "3", "--out", str(out))

    tokens = out.read_text().split()
    assert len(set(tokens)) == 3 and stat.S_IMODE(out.stat().st_mode) == 0o600
    users = get_user_model().objects.filter(username__startswith="loadtest-r1-")
    assert not any(u.is_staff or u.is_superuser or u.has_usable_password() for u in users)
    tenants = {m.tenant.name for m in TenantMembership.objects.filter(user__in=users)}
    assert tenants == {"loadtest-1", "loadtest-2", "loadtest-3"}
    for token in tokens:
        assert client_with(token).get("/api/v1/sessions/").status_code == 200
    # a session of loadtest-2's: that tenant stays (its sessions do), the others go
    Session.objects.create(tenant=Tenant.objects.get(name="loadtest-2"), target=tiny_model, drafter="ngram",
                           queue="cpu", prompt="x", prompt_tokens=1)

    call_command("loadtest_tenants", "remove", "--run", "r1")

    assert not get_user_model().objects.filter(username__startswith="loadtest-r1-").exists()
    assert all(client_with(token).get("/api/v1/sessions/").status_code == 401 for token in tokens)
    assert set(Tenant.objects.filter(name__startswith="loadtest-").values_list("name", flat=True)) == {"loadtest-2"}

    call_command("loadtest_tenants", "create", "--run", "r2", "--count", "2", "--out", str(out))  # reused
    assert Tenant.objects.filter(name="loadtest-2").count() == 1 and len(out.read_text().split()) == 2


@pytest.mark.parametrize(("args", "message"), [
    (["create", "--run", "r", "--count", "0", "--out", "x"], "--count must be from 1"),
    (["create", "--run", "r", "--count", "2"], "create needs --out"),
    (["remove", "--run", "../etc"], "--run must be letters"),
])
def test_bad_arguments_are_one_line_errors(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("loadtest_tenants", *args)


def test_a_run_id_in_use_is_refused(tmp_path):
    call_command("loadtest_tenants", "create", "--run", "r3", "--count", "1", "--out", str(tmp_path / "a"))
    with pytest.raises(CommandError, match="has users already"):
        call_command("loadtest_tenants", "create", "--run", "r3", "--count", "1", "--out", str(tmp_path / "b"))
