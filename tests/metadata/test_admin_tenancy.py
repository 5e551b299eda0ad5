"""The admin holds the tenant boundary: staff see their own tenant's data, superusers every tenant's.

Also: an active model version's serving fields cannot be edited in place (only promotion changes
what is served), a bad query string on the session page is no 500, and the admin's sign-in is
throttled per client address and per username.
"""
from __future__ import annotations

import base64
import json

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.cache import cache
from django.test import Client

from inference.models import CanaryMismatch

from metadata.models import ModelVersion, VersionStatus
from metadata.models import Session, Tenant, TenantMembership

pytestmark = pytest.mark.django_db
PASSWORD = "pw-operator-123"
VIEW_PERMS = ("metadata.view_session", "metadata.view_tenant", "metadata.view_tenantmembership",
              "metadata.change_tenant", "inference.view_canarymismatch")


def staff(username: str, tenant: Tenant | None, *perms: str, superuser: bool = False) -> Client:
    user = get_user_model().objects.create_user(username, password=PASSWORD, is_staff=True, is_superuser=superuser)
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app_label, codename=codename))
    if tenant is not None:
        TenantMembership.objects.create(user=user, tenant=tenant)
    client = Client()
    client.force_login(user)
    return client


def session_of(tenant: Tenant, model: ModelVersion, prompt: str) -> Session:
    return Session.objects.create(tenant=tenant, target=model, drafter="ngram", queue="cpu", prompt=prompt,
                                  prompt_tokens=1, params={}, status="succeeded", text=f"output of {prompt}")


@pytest.fixture
def two_tenants(tiny_model):
    acme, globex = Tenant.objects.create(name="acme"), Tenant.objects.create(name="globex")
    return acme, globex, session_of(acme, tiny_model, "acme secret plan"), session_of(globex, tiny_model,
                                                                                       "globex secret plan")


def test_staff_see_their_own_tenants_sessions_only(two_tenants):
    acme, globex, ours, theirs = two_tenants
    client = staff("acme-ops", acme, *VIEW_PERMS)
    page = client.get("/admin/metadata/session/").content.decode()
    assert str(ours.pk) in page and str(theirs.pk) not in page
    mine = client.get(f"/admin/metadata/session/{ours.pk}/change/")
    assert mine.status_code == 200 and "acme secret plan" in mine.content.decode()
    other = client.get(f"/admin/metadata/session/{theirs.pk}/change/", follow=True)
    assert "globex secret plan" not in other.content.decode()  # as absent as a missing session
    search = client.get(f"/admin/metadata/session/?q={theirs.pk}").content.decode()
    assert f"/admin/metadata/session/{theirs.pk}/change/" not in search and "0 results" in search


def test_staff_see_their_own_tenant_and_memberships_only(two_tenants):
    acme, globex, _, _ = two_tenants
    client = staff("acme-ops", acme, *VIEW_PERMS)
    TenantMembership.objects.create(user=get_user_model().objects.create_user("globex-user"), tenant=globex)
    tenants = client.get("/admin/metadata/tenant/").content.decode()
    assert "acme" in tenants and "globex" not in tenants
    assert client.get(f"/admin/metadata/tenant/{globex.pk}/change/", follow=True).status_code == 200
    assert "globex" not in client.get(f"/admin/metadata/tenant/{globex.pk}/change/", follow=True).content.decode() \
        .split('id="content"')[-1].split("</h1>")[0]
    memberships = client.get("/admin/metadata/tenantmembership/").content.decode()
    assert "acme-ops" in memberships and "globex-user" not in memberships


def test_staff_cannot_group_their_tenant_with_another(two_tenants):
    acme, _, _, _ = two_tenants
    client = staff("acme-ops", acme, *VIEW_PERMS)
    client.post(f"/admin/metadata/tenant/{acme.pk}/change/", {
        "name": "acme", "max_live_generations": "", "max_open_streams": "", "prefix_cache_group": "globex-group",
        "created_at_0": "2026-01-01", "created_at_1": "00:00:00"})
    assert Tenant.objects.get(pk=acme.pk).prefix_cache_group in ("", None)


def test_staff_in_no_tenant_see_no_sessions_and_superusers_see_all(two_tenants):
    _, _, ours, theirs = two_tenants
    nobody = staff("floating-ops", None, *VIEW_PERMS).get("/admin/metadata/session/").content.decode()
    assert str(ours.pk) not in nobody and str(theirs.pk) not in nobody
    everyone = staff("root", None, superuser=True).get("/admin/metadata/session/").content.decode()
    assert str(ours.pk) in everyone and str(theirs.pk) in everyone


def test_canary_mismatches_are_scoped_to_their_sessions_tenant(two_tenants):
    acme, _, ours, theirs = two_tenants
    for session in (ours, theirs):
        CanaryMismatch.objects.create(session_id=session.pk, session_created_at=session.created_at, model="tiny:1",
                                      drafter="ngram", first_difference=0, served_tokens=[1], replayed_tokens=[2],
                                      served_text=f"served {session.prompt}", replayed_text="x")
    page = staff("acme-ops", acme, *VIEW_PERMS).get("/admin/inference/canarymismatch/").content.decode()
    assert str(ours.pk) in page and str(theirs.pk) not in page


def cursor(values) -> str:
    return base64.urlsafe_b64encode(json.dumps(values).encode()).decode().rstrip("=")


@pytest.mark.parametrize("steps", ["WyJ4Il0", cursor(["x"]), cursor([1.5]), cursor([True]), cursor([2**70]),
                                   cursor([1, 2]), cursor({"a": 1}), "%00", "!!!", cursor([-5])])
def test_the_session_page_survives_a_cursor_it_did_not_issue(two_tenants, steps):
    acme, _, ours, _ = two_tenants
    response = staff("acme-ops", acme, *VIEW_PERMS).get(f"/admin/metadata/session/{ours.pk}/change/?steps={steps}")
    assert response.status_code in (200, 400), response.status_code


def test_the_session_page_with_the_issues_cursor_shows_the_first_page(two_tenants):
    acme, _, ours, _ = two_tenants
    response = staff("acme-ops", acme, *VIEW_PERMS).get(f"/admin/metadata/session/{ours.pk}/change/?steps=WyJ4Il0")
    assert response.status_code == 200 and "acme secret plan" in response.content.decode()


def version_form(version: ModelVersion, **changes) -> dict:
    fields = {"name": version.name, "version": version.version, "role": version.role, "path": version.path,
              "device": version.device, "context_length": version.context_length, "dtype": version.dtype,
              "default_draft": version.default_draft_id or "", "dspark_path": version.dspark_path}
    return {**{k: "" if v is None else v for k, v in fields.items()}, **changes}


def test_an_active_versions_serving_fields_are_read_only(tiny_model):
    client = staff("ml-ops", None, "metadata.change_modelversion", "metadata.view_modelversion",
                   "metadata.delete_modelversion")
    assert tiny_model.status == VersionStatus.ACTIVE
    url = f"/admin/metadata/modelversion/{tiny_model.pk}/change/"
    client.post(url, version_form(tiny_model, path="/tmp/elsewhere", device="cuda:7", context_length=99))
    tiny_model.refresh_from_db()
    assert (tiny_model.path, tiny_model.device, tiny_model.context_length) != ("/tmp/elsewhere", "cuda:7", 99)
    assert client.get(url).content.decode().count('name="path"') == 0  # shown, not an input
    assert client.post(f"/admin/metadata/modelversion/{tiny_model.pk}/delete/", {"post": "yes"}).status_code == 403
    assert ModelVersion.objects.filter(pk=tiny_model.pk).exists()


def test_a_staged_versions_fields_stay_editable(tiny_model):
    staged = ModelVersion.objects.create(name="tiny", version="2", role="target", path=tiny_model.path,
                                         device="cpu", context_length=64, status=VersionStatus.STAGED)
    client = staff("ml-ops", None, "metadata.change_modelversion", "metadata.view_modelversion")
    response = client.post(f"/admin/metadata/modelversion/{staged.pk}/change/",
                           version_form(staged, context_length=32))
    assert response.status_code == 302, response.content.decode()[:2000]
    assert ModelVersion.objects.get(pk=staged.pk).context_length == 32


@pytest.fixture
def login_rate(settings):
    cache.delete_pattern("throttle:*")
    settings.SPECOPS_THROTTLE_LOGIN_RATE = "3/min"
    yield
    cache.delete_pattern("throttle:*")


def test_the_admin_sign_in_is_throttled_per_address(login_rate, db):
    client = Client(REMOTE_ADDR="203.0.113.7")
    codes = [client.post("/admin/login/", {"username": f"guess{n}", "password": "x"}).status_code for n in range(5)]
    assert codes == [200, 200, 200, 429, 429]  # 200: the form again, with its error
    refused = client.post("/admin/login/", {"username": "guess9", "password": "x"})
    assert int(refused["Retry-After"]) >= 1 and b"Too many sign-in attempts" in refused.content
    assert Client(REMOTE_ADDR="203.0.113.8").post("/admin/login/", {"username": "other", "password": "x"}) \
        .status_code == 200


def test_the_admin_sign_in_is_throttled_per_username(login_rate, db):
    user = get_user_model().objects.create_user("ops", password=PASSWORD, is_staff=True)
    codes = [Client(REMOTE_ADDR=f"198.51.100.{n}").post("/admin/login/", {"username": "ops", "password": "x"})
             .status_code for n in range(4)]
    assert codes == [200, 200, 200, 429]
    right = Client(REMOTE_ADDR="198.51.100.99").post("/admin/login/", {"username": user.username, "password": PASSWORD})
    assert right.status_code == 429  # not even the right password is checked past the limit
