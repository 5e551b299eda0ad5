"""A /v1/ client that disconnects before its reply ends cancels its generation
(SPECOPS_CANCEL_ON_DISCONNECT), on the real ASGI server (uvicorn).

No worker reads the tests' broker here, so the generation stays queued until the client gives up;
the cancellation is what ends it. With the setting off it stays queued."""
from __future__ import annotations

import time

import httpx2
import pytest
from rest_framework.authtoken.models import Token

from metadata.models import Session, SessionStatus
from tests.helpers import wait_for
from tests.web_process import start_web, stop_web

pytest_plugins = ["tests.web_process"]
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def token(api_user) -> str:
    return Token.objects.create(user=api_user).key


def give_up(web, token: str, model: str, stream: bool) -> None:
    """Ask for a completion and hang up before it ends: a waiting client after a 2 s read timeout,
    a streaming one after its first chunk (heartbeats keep a stream's reads from timing out)."""
    body = {"model": model, "prompt": "import os\n", "max_tokens": 4, "temperature": 0.7, "stream": stream}
    request = httpx2.stream("POST", f"{web.url}/v1/completions", json=body, timeout=httpx2.Timeout(10, read=2),
                            headers={"Authorization": f"Bearer {token}"})
    if not stream:
        with pytest.raises(httpx2.ReadTimeout), request:
            pass  # the reply's headers come with its end
        return
    with request as response:  # leaving it closes the connection
        assert response.status_code == 200 and next(response.iter_bytes())


def session_of(tenant) -> Session:
    return wait_for(lambda: Session.objects.filter(tenant=tenant).order_by("-created_at").first(),
                    what="the session row")


@pytest.mark.parametrize("stream", [False, True], ids=["waiting", "streaming"])
def test_a_client_that_disconnects_cancels_its_generation(live_web, tenant, token, tiny_model, stream):
    give_up(live_web, token, tiny_model.name, stream)
    session = session_of(tenant)
    wait_for(lambda: Session.objects.get(pk=session.pk).status == SessionStatus.CANCELLED, timeout=10,
             what="the abandoned generation cancelled")
    assert Session.objects.get(pk=session.pk).finish_reason == "cancelled"


def test_with_the_setting_off_the_generation_goes_on(tmp_path, tenant, token, tiny_model):
    web = start_web(tmp_path / "web.log", SPECOPS_CANCEL_ON_DISCONNECT="false")
    try:
        give_up(web, token, tiny_model.name, stream=False)
        session = session_of(tenant)
        time.sleep(2)  # what cancels does so within milliseconds of the hang-up
        assert Session.objects.get(pk=session.pk).status == SessionStatus.QUEUED
    finally:
        stop_web(web)
