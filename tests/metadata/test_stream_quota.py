"""A tenant's open session streams are bounded: past its limit one more is a 429 naming the limit,
with Retry-After; a closed stream frees its place, and a place a dead web process left lapses.

Served by the real ASGI server (uvicorn), counted in the real Redis (``sessions.streams.follow``).
"""
from __future__ import annotations

import contextlib
import time

import httpx2
import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token

from sessions.streams.follow import StreamSlot
from metadata.models import Tenant, TenantMembership
from sessions.streams import token_stream
from tests.helpers import wait_for
from tests.inference.api.test_streaming import new_session, target, token  # noqa: F401  (fixtures)

pytest_plugins = ["tests.web_process"]
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def open_stream(stack: contextlib.ExitStack, web, session_id, key: str) -> httpx2.Response:
    return stack.enter_context(httpx2.stream("GET", f"{web.url}/api/v1/sessions/{session_id}/stream/", timeout=15,
                                             headers={"Authorization": f"Token {key}"}))


def slots(tenant) -> int:
    return token_stream.client().zcard(StreamSlot.key_of(tenant.pk))


def test_past_its_limit_a_tenant_gets_a_429_and_a_closed_stream_frees_its_place(live_web, tenant, target, token):
    token_stream.client().delete(StreamSlot.key_of(tenant.pk))
    Tenant.objects.filter(pk=tenant.pk).update(max_open_streams=2)
    session = new_session(tenant, target, status="queued")  # never ends: each stream stays open
    other = Tenant.objects.create(name="globex")
    user = get_user_model().objects.create_user("bob")
    TenantMembership.objects.create(user=user, tenant=other)
    other_key = Token.objects.create(user=user).key
    other_session = new_session(other, target, status="queued")

    with contextlib.ExitStack() as first:
        assert open_stream(first, live_web, session.pk, token).status_code == 200
        with contextlib.ExitStack() as second:
            assert open_stream(second, live_web, session.pk, token).status_code == 200
            assert slots(tenant) == 2
            refused = httpx2.get(f"{live_web.url}/api/v1/sessions/{session.pk}/stream/",
                                 headers={"Authorization": f"Token {token}"}, timeout=15)
            assert refused.status_code == 429 and refused.headers["Retry-After"] == "5"
            body = refused.json()
            assert "max_open_streams=2" in body["detail"] and "2 session streams open" in body["detail"]
            assert open_stream(second, live_web, other_session.pk, other_key).status_code == 200  # its own count
        wait_for(lambda: slots(tenant) == 1, timeout=10, interval=0.1, what="the closed stream's slot released")
        with contextlib.ExitStack() as third:
            assert open_stream(third, live_web, session.pk, token).status_code == 200


def test_a_place_a_dead_web_process_left_lapses(live_web, tenant, target, token):
    key = StreamSlot.key_of(tenant.pk)
    token_stream.client().delete(key)
    Tenant.objects.filter(pk=tenant.pk).update(max_open_streams=1)
    token_stream.client().zadd(key, {"left-by-a-dead-process": time.time() - 1})  # lapsed a second ago
    session = new_session(tenant, target, status="queued")
    with contextlib.ExitStack() as stack:
        assert open_stream(stack, live_web, session.pk, token).status_code == 200
        assert token_stream.client().zrange(key, 0, -1) != [b"left-by-a-dead-process"]
