"""Token authentication through the two-tier cache (``metadata.api.authentication``): no query once
cached, and a revoked token, a deactivated user or a changed membership is seen at once."""
from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.authtoken.models import Token
from rest_framework.exceptions import AuthenticationFailed

from metadata.api.async_views import Refused, authorize
from metadata.api.authentication import CachedTokenAuthentication, token_cache
from metadata.models import Tenant, TenantMembership
from metadata.replicas import lsn

pytestmark = pytest.mark.django_db(transaction=True)  # invalidation runs after commit


@pytest.fixture
def token(api_user):
    token_cache().clear_local()
    return Token.objects.create(user=api_user)


def authenticate(key: str):
    with lsn.floor_scope():  # one request's floor, as the middleware gives it
        return CachedTokenAuthentication().authenticate_credentials(key)


def test_a_cached_token_costs_no_query_and_brings_its_tenant(token, tenant):
    authenticate(token.key)
    with CaptureQueriesContext(connection) as queries:
        user, cached = authenticate(token.key)
        assert user.membership.tenant.name == tenant.name  # related rows cached too
    assert len(queries) == 0, [q["sql"] for q in queries]
    assert cached.key == token.key and user.pk == token.user_id


def test_each_request_gets_its_own_user_instance(token):
    first, _ = authenticate(token.key)
    first.some_attribute = "set by a view"
    second, _ = authenticate(token.key)
    assert second is not first and not hasattr(second, "some_attribute")


def test_a_deleted_token_is_refused_at_once(token):
    authenticate(token.key)
    Token.objects.filter(key=token.key).delete()
    with pytest.raises(AuthenticationFailed):
        authenticate(token.key)


def test_a_deactivated_user_is_refused_at_once(token, api_user):
    authenticate(token.key)
    api_user.is_active = False
    api_user.save()
    with pytest.raises(AuthenticationFailed, match="inactive"):
        authenticate(token.key)


def test_a_moved_membership_is_seen_at_once(token, api_user):
    assert authenticate(token.key)[0].membership.tenant.name == "acme"
    other = Tenant.objects.create(name="globex")
    TenantMembership.objects.filter(user=api_user).delete()
    TenantMembership.objects.create(user=api_user, tenant=other)
    assert authenticate(token.key)[0].membership.tenant.name == "globex"


def test_a_user_without_membership_has_none_without_a_query(db):
    user = get_user_model().objects.create_user("loner")
    key = Token.objects.create(user=user).key
    authenticate(key)
    with CaptureQueriesContext(connection) as queries:
        cached_user, _ = authenticate(key)
        assert getattr(cached_user, "membership", None) is None
    assert len(queries) == 0


def test_an_unknown_token_is_refused():
    with pytest.raises(AuthenticationFailed, match="Invalid token"):
        authenticate("0" * 40)


def test_the_streams_and_the_openai_protocol_authenticate_through_the_cache(token, tenant, rf):
    """``authorize`` (the async views' DRF part: session streams, every /v1/ request) reads the same
    cache: a known token costs no query (it cost two: the token and user, the membership and tenant)."""
    request = rf.get("/", HTTP_AUTHORIZATION=f"Bearer {token.key}")
    with lsn.floor_scope():
        authorize(request)
    with CaptureQueriesContext(connection) as queries, lsn.floor_scope():
        caller = authorize(rf.get("/", HTTP_AUTHORIZATION=f"Bearer {token.key}"))
    assert len(queries) == 0, [q["sql"] for q in queries]
    assert caller.tenant.name == tenant.name and caller.user.pk == token.user_id
    Token.objects.filter(key=token.key).delete()  # and a revoked token is refused at once
    with pytest.raises(Refused) as refused, lsn.floor_scope():
        authorize(rf.get("/", HTTP_AUTHORIZATION=f"Bearer {token.key}"))
    assert refused.value.status == 401
