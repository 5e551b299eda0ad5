"""The OpenAI-compatible API, driven by the official ``openai`` client against the live ASGI
server (uvicorn) and a real Celery worker: the same tokens, tenants, sessions and prediction
cache as the REST API."""
from __future__ import annotations

import httpx2
import openai
import pytest
from rest_framework.authtoken.models import Token

from inference.tokenizers import tokenizer_for
from metadata.models import Session, TokenRecord
from sessions.streams import token_stream
from specops.celery import app
from tests.worker_process import start_worker, stop_worker

pytest_plugins = ["tests.web_process"]  # live_web: one uvicorn server for the run
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

PROMPT = "def parse(text):\n    "


@pytest.fixture(scope="module")
def cpu_worker(django_db_setup, tmp_path_factory):
    app.control.purge()
    process = start_worker("cpu", "openai-cpu", tmp_path_factory.mktemp("worker") / "worker.log")
    yield process
    stop_worker(process)


@pytest.fixture(autouse=True)
def cold_prediction_cache():
    """Ids restart with each test database while Redis keeps entries: forget earlier runs' results."""
    client = token_stream.client()
    for key in client.scan_iter("specops:pred:*", count=1000):
        client.delete(key)


@pytest.fixture
def token(api_user) -> str:
    return Token.objects.create(user=api_user).key


@pytest.fixture
def client(live_web, token) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_web.url}/v1", api_key=token, max_retries=0, timeout=120)


def session_of(reply_id: str) -> Session:
    return Session.objects.get(pk=reply_id.split("-", 1)[1])


def generated_text(session: Session) -> str:
    """What the worker generated, decoded as the API returns it (special tokens skipped)."""
    ids = list(TokenRecord.objects.filter(session_id=session.pk).order_by("position").values_list("token_id", flat=True))
    return tokenizer_for(str(session.target.directory)).decode(ids, skip_special_tokens=True,
                                                               clean_up_tokenization_spaces=False)


def test_models_and_protocol_errors(client, live_web, tiny_model):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "specops"

    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"

    with pytest.raises(openai.BadRequestError) as several:
        client.completions.create(model="tiny", prompt="x", n=2)
    assert several.value.body["param"] == "n" and several.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as hot:
        client.completions.create(model="tiny", prompt="x", temperature=3)
    assert hot.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as tools:  # a tool result that answers no call
        client.chat.completions.create(model="tiny", tools=[{"type": "function", "function": {"name": "f"}}],
                                       messages=[{"role": "tool", "tool_call_id": "call_1", "content": "hi"}])
    assert tools.value.body["param"] == "messages[0].tool_call_id"

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live_web.url}/v1", api_key="not-a-token", max_retries=0).models.list()
    anonymous = httpx2.post(f"{live_web.url}/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert anonymous.status_code == 401
    assert set(anonymous.json()["error"]) == {"message", "type", "param", "code"}
    assert Session.objects.count() == 0


def test_completion_then_the_same_request_streamed_from_the_prediction_cache(client, tiny_model, cpu_worker):
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)

    session = session_of(reply.id)
    assert reply.object == "text_completion" and reply.model == "tiny"
    assert session.status == "succeeded" and session.prompt == PROMPT and session.params["max_new_tokens"] == 12
    choice = reply.choices[0]
    assert choice.text == generated_text(session)
    assert choice.finish_reason == {"length": "length", "eos": "stop"}[session.finish_reason]
    assert reply.usage.prompt_tokens == session.prompt_tokens
    assert reply.usage.completion_tokens == session.token_count
    assert reply.usage.total_tokens == session.prompt_tokens + session.token_count

    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))

    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == session.token_count
    assert all(c.usage is None for c in chunks[:-1])
    assert session_of(chunks[0].id).stats["prediction_cache"]["hit"] is True  # a deterministic repeat


def test_chat_completion_and_a_live_stream(client, tiny_model, cpu_worker):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Write a parser."}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)

    session = session_of(reply.id)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == generated_text(session)
    assert session.prompt == "### System:\nBe terse.\n\n### User:\nWrite a parser.\n\n### Assistant:\n"

    stream = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6,
                                            temperature=0.8, seed=7, stream=True)
    chunks = list(stream)

    streamed = session_of(chunks[0].id)
    assert "prediction_cache" not in streamed.stats  # a live generation, followed on its stream
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == generated_text(streamed)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert streamed.params["max_new_tokens"] == 6 and streamed.params["seed"] == 7


def test_a_stop_sequence_ends_the_text_before_it(client, tiny_model, cpu_worker):
    prompt = "import os\n"
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    window = next((full[i:i + 2] for i in range(len(full) // 2, len(full) - 1)
                   if full[i:i + 2].isascii() and full[i:i + 2].strip() == full[i:i + 2]), None)
    assert window, f"no ASCII pair to stop on in {full!r}"
    expected = full[:full.find(window)]

    stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[window])
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=window,
                                         stream=True)

    assert stopped.choices[0].text == expected and stopped.choices[0].finish_reason == "stop"
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
