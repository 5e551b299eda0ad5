"""One stream follower's failure stays its own (the real ASGI server, one stream hub per process).

Tenant A opens 30 streams of its own session with a ``Last-Event-ID`` Redis refuses (a stream id
part above 2^64 - 1) while tenant B follows its running session in the same web process: A's
streams are refused before they open (400 naming the header), and B's stream goes on to its end.
"""
from __future__ import annotations

import asyncio
import threading
import time

import httpx2
import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token

from metadata.models import Tenant, TenantMembership
from sessions.streams import token_stream
from tests.inference.api.test_streaming import events, new_session, parse_sse, read_stream, target  # noqa: F401
from tests.web_process import IDLE_LIMIT_S

pytest_plugins = ["tests.web_process"]  # live_web: one uvicorn server for the run
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
REDIS_REFUSES = "99999999999999999999-0"  # 20 digits, above 2^64 - 1


def tenant_token(name: str) -> tuple[Tenant, str]:
    tenant = Tenant.objects.create(name=name)
    user = get_user_model().objects.create_user(f"{name}-user")
    TenantMembership.objects.create(user=user, tenant=tenant)
    return tenant, Token.objects.create(user=user).key


class Follower(threading.Thread):
    """Tenant B's stream, read as it arrives; ``first`` is set once its first event came."""

    def __init__(self, url: str, token: str) -> None:
        super().__init__(daemon=True)
        self.url, self.token = url, token
        self.text, self.first = "", threading.Event()

    def run(self) -> None:
        with httpx2.stream("GET", self.url, timeout=IDLE_LIMIT_S + 10,
                           headers={"Authorization": f"Token {self.token}"}) as response:
            for chunk in response.iter_text():
                self.text += chunk
                if "event: tokens" in self.text:
                    self.first.set()


async def open_streams(url: str, token: str, count: int) -> list[tuple[int, str]]:
    async def one(client) -> tuple[int, str]:
        async with client.stream("GET", url, headers={"Authorization": f"Token {token}",
                                                      "Last-Event-ID": REDIS_REFUSES}) as response:
            return response.status_code, "".join([chunk async for chunk in response.aiter_text()])

    async with httpx2.AsyncClient(timeout=IDLE_LIMIT_S + 10) as client:
        return await asyncio.gather(*(one(client) for _ in range(count)))


def test_a_tenants_streams_with_an_id_redis_refuses_end_no_other_tenants_stream(live_web, target):  # noqa: F811
    tenant_a, token_a = tenant_token("hostile-a")
    tenant_b, token_b = tenant_token("victim-b")
    session_a, session_b = new_session(tenant_a, target), new_session(tenant_b, target)
    token_stream.publish(session_b.pk, "tokens", {"step": 0, "token_ids": [1], "text": "a"}, step=0)
    follower = Follower(f"{live_web.url}/api/v1/sessions/{session_b.pk}/stream/", token_b)
    follower.start()
    assert follower.first.wait(10), "B's stream did not start"

    refused = asyncio.run(open_streams(f"{live_web.url}/api/v1/sessions/{session_a.pk}/stream/", token_a, 30))
    time.sleep(0.5)  # the hub's next read, with whatever A's streams left in it
    token_stream.publish(session_b.pk, "tokens", {"step": 1, "token_ids": [2], "text": "b"}, step=1)
    token_stream.publish(session_b.pk, "done", {"status": "succeeded", "finish_reason": "length", "error": ""},
                         step=2)
    follower.join(IDLE_LIMIT_S + 10)

    assert [event["event"] for event in events(parse_sse(follower.text))] == ["tokens", "tokens", "done"], \
        follower.text
    assert {status for status, _ in refused} == {400}, refused[0]
    assert "Last-Event-ID" in refused[0][1] and "18446744073709551615" in refused[0][1]
    # the largest id Redis takes is an id like any other: the stream opens and resumes after it
    session_b.status = "succeeded"
    session_b.save()
    status, messages = read_stream(live_web, session_b.pk, token_b, **{"Last-Event-ID": "18446744073709551615-0"})
    assert status == 200 and [m["event"] for m in events(messages)] == ["done"]
