"""GET /api/v1/sessions/{id}/stream/ served by the real ASGI server (uvicorn) from Redis Streams.

Events are published to the real Redis as a worker would (``token_stream.publish``), so these
tests need no model run: the format, ``Last-Event-ID``, heartbeats, the final events, the idle
limit, and many open streams not holding up the rest of the API.
"""
from __future__ import annotations

import asyncio
import threading
import time

import httpx2
import pytest
from rest_framework.authtoken.models import Token

from metadata.models import ModelVersion
from metadata.models import Session, Tenant
from sessions.streams import token_stream
from tests.web_process import HEARTBEAT_S, IDLE_LIMIT_S

pytest_plugins = ["tests.web_process"]  # live_web: one uvicorn server for the run
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def web(live_web):
    return live_web


@pytest.fixture
def token(api_user) -> str:
    return Token.objects.create(user=api_user).key


@pytest.fixture
def target(db) -> ModelVersion:
    return ModelVersion.objects.create(name="streamed", version="1", role="target", path="/nonexistent",
                                       context_length=512, status="active")


def new_session(tenant, target, status="running") -> Session:
    return Session.objects.create(tenant=tenant, target=target, drafter="ngram", queue="cpu", prompt="x",
                                  prompt_tokens=1, status=status)


def parse_sse(text: str) -> list[dict]:
    """Each message as its fields; a comment as {"comment": ...}."""
    messages = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        fields: dict = {}
        for line in block.split("\n"):
            name, _, value = line.partition(":")
            if name == "":
                fields["comment"] = value.strip()
            else:
                fields[name] = value.removeprefix(" ")
        messages.append(fields)
    return messages


def read_stream(web, session_id, token: str, timeout: float = 15.0, **headers: str) -> tuple[int, list[dict]]:
    with httpx2.stream("GET", f"{web.url}/api/v1/sessions/{session_id}/stream/", timeout=timeout,
                       headers={"Authorization": f"Token {token}", **headers}) as response:
        return response.status_code, parse_sse("".join(response.iter_text()))


def events(messages: list[dict]) -> list[dict]:
    return [m for m in messages if "event" in m]


def test_the_stream_replays_every_event_with_its_entry_id_and_resumes_after_last_event_id(web, tenant, target,
                                                                                          token):
    session = new_session(tenant, target)
    token_stream.publish(session.pk, "tokens", {"step": 0, "token_ids": [1, 2], "text": "ab"})
    token_stream.publish(session.pk, "tokens", {"step": 1, "token_ids": [3], "text": "c"})
    token_stream.publish(session.pk, "tokens", {"step": 2, "token_ids": [4], "text": "d"})
    token_stream.publish(session.pk, "done", {"status": "succeeded", "finish_reason": "length", "error": ""})

    status, messages = read_stream(web, session.pk, token)

    assert status == 200
    got = events(messages)
    assert [m["event"] for m in got] == ["tokens", "tokens", "tokens", "done"]
    assert got[0]["data"] == '{"step": 0, "token_ids": [1, 2], "text": "ab"}'  # today's data format
    assert all(token_stream.is_entry_id(m["id"]) for m in got)
    assert got[-1]["data"] == '{"status": "succeeded", "finish_reason": "length", "error": ""}'

    _, resumed = read_stream(web, session.pk, token, **{"Last-Event-ID": got[1]["id"]})
    assert [m["data"] for m in events(resumed)] == [m["data"] for m in got[2:]]
    status, _ = read_stream(web, session.pk, token, **{"Last-Event-ID": "not-an-id"})
    assert status == 400


def test_live_events_arrive_as_published_with_heartbeats_while_quiet(web, tenant, target, token):
    session = new_session(tenant, target, status="queued")

    def worker():
        time.sleep(4 * HEARTBEAT_S)
        token_stream.publish(session.pk, "tokens", {"step": 0, "token_ids": [7], "text": "x"})
        token_stream.publish(session.pk, "done", {"status": "succeeded", "finish_reason": "eos", "error": ""})

    thread = threading.Thread(target=worker)
    thread.start()
    _, messages = read_stream(web, session.pk, token)
    thread.join()

    assert any(m.get("comment") == "heartbeat" for m in messages)
    assert [m["event"] for m in events(messages)] == ["tokens", "done"]


def test_a_session_that_ended_without_a_done_event_gets_one(web, tenant, target, token):
    """The reconciler fails a session whose worker died, an operator cancels one: no worker says done."""
    # a tenant sees the error's stable message and code, not the stored detail (a worker's host name)
    for status, error, shown in (("failed", "worker lost (attempt 3 of 3, on cpu@host-7)",
                                  '"error_code": "worker_lost"'), ("cancelled", "", '"error": ""')):
        session = new_session(tenant, target, status=status)
        Session.objects.filter(pk=session.pk).update(error=error)

        _, messages = read_stream(web, session.pk, token)

        assert [m["event"] for m in events(messages)] == ["done"]
        assert f'"status": "{status}"' in events(messages)[0]["data"]
        assert shown in events(messages)[0]["data"] and "host-7" not in events(messages)[0]["data"]


def test_an_idle_stream_ends_with_an_explicit_timeout_event(web, tenant, target, token):
    session = new_session(tenant, target, status="queued")
    started = time.monotonic()
    _, messages = read_stream(web, session.pk, token)
    assert IDLE_LIMIT_S - 0.5 <= time.monotonic() - started < IDLE_LIMIT_S + 5
    assert events(messages)[-1]["event"] == "timeout"
    assert "Last-Event-ID" in events(messages)[-1]["data"]


def test_auth_and_tenancy(web, tenant, target, token):
    session = new_session(tenant, target)
    assert httpx2.get(f"{web.url}/api/v1/sessions/{session.pk}/stream/").status_code == 401
    other = new_session(Tenant.objects.create(name="other"), target)
    response = httpx2.get(f"{web.url}/api/v1/sessions/{other.pk}/stream/", headers={"Authorization": f"Token {token}"})
    assert response.status_code == 404 and response.json()["status"] == 404


def test_open_streams_do_not_hold_up_the_api(web, tenant, target, token):
    """The gthread trap: 8 open streams stalled every other request. Under ASGI they hold no thread."""
    sessions = [new_session(tenant, target, status="queued") for _ in range(40)]
    auth = {"Authorization": f"Token {token}"}

    async def scenario() -> tuple[list[float], list[list[str]]]:
        limits = httpx2.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx2.AsyncClient(base_url=web.url, headers=auth, timeout=30, limits=limits) as client:
            opened = [asyncio.Event() for _ in sessions]

            async def follow(index: int, session: Session) -> list[str]:
                seen = []
                async with client.stream("GET", f"/api/v1/sessions/{session.pk}/stream/") as response:
                    async for line in response.aiter_lines():
                        if line.startswith(":"):
                            opened[index].set()
                        if line.startswith("event:"):
                            seen.append(line)
                return seen

            tasks = [asyncio.create_task(follow(i, s)) for i, s in enumerate(sessions)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), timeout=IDLE_LIMIT_S - 1)
            latencies = []
            for _ in range(5):
                started = time.perf_counter()
                assert (await client.get("/api/v1/models/")).status_code == 200
                latencies.append(time.perf_counter() - started)
            for session in sessions:
                token_stream.publish(session.pk, "done", {"status": "succeeded", "finish_reason": "eos", "error": ""})
            return latencies, await asyncio.gather(*tasks)

    latencies, seen = asyncio.run(scenario())
    assert max(latencies) < 1.0, latencies
    assert all(lines == ["event: done"] for lines in seen)
