"""No input is a server error: every field of every POST body and every query parameter, both APIs.

Each body field (from the serializers' and the OpenAI parser's own field lists) and each query
parameter gets values the database or the code cannot take as they are: NUL characters, lone
surrogates (JSON ``"\\ud800"``), integers beyond 64 bits, negative, fractional, boolean, null,
list and object values, and the same nested. Every answer must be below 500; the text rules
(NUL, lone surrogate) must be a 400 that names the field and the rule, in the called API's shape.
No worker runs: a valid OpenAI request ends in its 504 ``timeout`` (the wait is cut short), which
is the server saying "not done yet", not a failure.
"""
from __future__ import annotations

import base64
import json
from urllib.parse import quote

import pytest
import redis
from django.conf import settings
from django.test import Client
from rest_framework.authtoken.models import Token

from inference.api.openai.serializers import (
    COMMON_FIELDS,
    IGNORED,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
)
from inference.api.serializers import GenerationRequestSerializer
from metadata.models import Session

NUL = "a\x00b"
SURROGATE = "a\ud800b"
HOSTILE = [NUL, SURROGATE, 10**30, -1, 1.5, float("nan"), float("-inf"), True, None, [], {}, [NUL],
           {"k": SURROGATE}, {NUL: 1}]
NUL_RULE = "must not contain NUL characters"
SURROGATE_RULE = "must be valid UTF-8"
REST_FIELDS = sorted(GenerationRequestSerializer().get_fields())
COMPLETION_FIELDS = sorted({*COMMON_FIELDS, "prompt", *IGNORED, *UNSUPPORTED_COMPLETION})
CHAT_FIELDS = sorted({*COMMON_FIELDS, "messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                      *IGNORED, *UNSUPPORTED_CHAT})
QUERY_VALUES = ["%00", "a%00b", "%ED%A0%80", "%FF", "9" * 40, "-1", "1.5", "true", "null", "%5B%5D", "",
                quote(base64.urlsafe_b64encode(json.dumps(["\x00", "\ud800"]).encode()).decode())]


@pytest.fixture(autouse=True)
def empty_cpu_queue():
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    broker.delete("cpu")
    yield
    broker.delete("cpu")


@pytest.fixture
def client(api_user, tiny_model, settings) -> Client:
    settings.SPECOPS_OPENAI_TIMEOUT_S = 0.05  # no worker runs: a valid request's wait ends at once
    return Client(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=api_user).key}")


def server_errors(responses: list[tuple[object, object]]) -> list[str]:
    """The cases answered with a 5xx (other than a valid generation's 504 timeout)."""
    failed = []
    for case, response in responses:
        timed_out = response.status_code == 504 and b'"timeout"' in response.content
        if response.status_code >= 500 and not timed_out:
            failed.append(f"{case!r}: {response.status_code} {response.content[:300]!r}")
    return failed


def post(client: Client, url: str, body: dict):
    return client.post(url, json.dumps(body), content_type="application/json")


ENDPOINTS = {
    "/api/v1/generations/": ({"prompt": "x = 1\n"}, REST_FIELDS),
    "/v1/completions": ({"model": "tiny", "prompt": "x = 1\n", "max_tokens": 2}, COMPLETION_FIELDS),
    "/v1/chat/completions": ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                             CHAT_FIELDS),
}


@pytest.mark.parametrize("url", ENDPOINTS)
def test_every_body_field(client, url):
    """Each field of the endpoint's own list, with each hostile value, on an otherwise valid body."""
    base, fields = ENDPOINTS[url]
    responses = [((field, value), post(client, url, {**base, field: value})) for field in fields for value in HOSTILE]
    assert len(responses) >= 10 * len(HOSTILE)
    assert not server_errors(responses)


def test_openai_message_parts(client):
    responses = []
    for value in HOSTILE:
        for message in ({"role": "user", "content": value}, {"role": value, "content": "hi"},
                        {"role": "user", "content": [{"type": "text", "text": value}]}, {"role": "user", value: 1}
                        if isinstance(value, str) else {"role": "user", "content": "hi", "name": value}):
            body = {"model": "tiny", "messages": [message], "max_tokens": 2}
            responses.append((message, post(client, "/v1/chat/completions", body)))
    assert not server_errors(responses)


@pytest.mark.parametrize("path", [
    "/api/v1/sessions/", "/api/v1/sessions/{session}/", "/api/v1/sessions/{session}/tokens/",
    "/api/v1/sessions/{session}/candidates/", "/api/v1/sessions/{session}/stream/", "/api/v1/models/",
    "/api/v1/models/{model}/", "/v1/models", "/v1/models/tiny",
])
def test_query_parameters(client, tenant, tiny_model, path):
    session = Session.objects.create(tenant=tenant, target=tiny_model, drafter="ngram", queue="cpu",
                                     prompt="x", prompt_tokens=1, params={}, status="succeeded")
    url = path.format(session=session.pk, model=tiny_model.pk)
    responses = []
    for name in ("cursor", "page_size", "model", "status", "format", "%00", "%ED%A0%80"):
        for value in QUERY_VALUES:
            responses.append(((url, name, value), client.get(f"{url}?{name}={value}")))
    assert not server_errors(responses)


def test_path_lookups(client):
    responses = []
    for segment in ("%00", "a%00b", "%ED%A0%80", "%FF", "9" * 40, "-1", "1.5", "%20", "..%2F"):
        for url in (f"/v1/models/{segment}", f"/api/v1/models/{segment}/", f"/api/v1/sessions/{segment}/",
                    f"/api/v1/sessions/{segment}/tokens/", f"/api/v1/sessions/{segment}/stream/"):
            responses.append((url, client.get(url)))
        responses.append(("promote", client.post(f"/api/v1/models/{segment}/promote/")))
        responses.append(("cancel", client.post(f"/api/v1/sessions/{segment}/cancel/")))
    assert not server_errors(responses)
    nul = client.get("/v1/models/a%00b")
    assert nul.status_code == 404 and nul.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(("value", "rule"), [(NUL, NUL_RULE), (SURROGATE, SURROGATE_RULE)])
def test_rest_text_rule_names_the_field(client, value, rule):
    response = post(client, "/api/v1/generations/", {"prompt": "x = 1\n", "model": value})
    assert response.status_code == 400, response.content
    assert rule in " ".join(response.json()["model"])
    response = post(client, "/api/v1/generations/", {"prompt": "x = 1\n", "stop": ["ok", value]})
    assert response.status_code == 400 and rule in json.dumps(response.json()["stop"])


@pytest.mark.parametrize(("value", "rule"), [(NUL, NUL_RULE), (SURROGATE, SURROGATE_RULE)])
@pytest.mark.parametrize(("path", "field", "body"), [
    ("/v1/completions", "model", {"prompt": "x"}),
    ("/v1/completions", "prompt", {"model": "tiny"}),
    ("/v1/completions", "user", {"model": "tiny", "prompt": "x"}),
    ("/v1/chat/completions", "model", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_openai_text_rule_names_the_param(client, path, field, body, value, rule):
    response = post(client, path, {**body, field: value})
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == field and rule in error["message"], error


def test_a_field_name_that_breaks_a_rule_is_refused(client):
    response = post(client, "/api/v1/generations/", {"prompt": "x = 1\n", "a\x00b": 1})
    assert response.status_code == 400 and NUL_RULE in " ".join(response.json()["non_field_errors"])
    response = post(client, "/v1/completions", {"model": "tiny", "prompt": "x", "a\ud800": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] is None


def test_openai_message_content_rule_names_the_message(client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": NUL}]}
    error = post(client, "/v1/chat/completions", body).json()["error"]
    assert error["param"] == "messages[1].content" and NUL_RULE in error["message"], error


def test_nul_in_a_query_parameter_names_it(client):
    response = client.get("/api/v1/sessions/?cursor=a%00b")
    assert response.status_code == 400
    assert NUL_RULE in json.dumps(response.json()) and "cursor" in json.dumps(response.json())
    response = client.get("/v1/models?x=%00")
    assert response.status_code == 400 and response.json()["error"]["param"] == "x"


def test_rest_unknown_fields_are_refused_by_name(client):
    response = post(client, "/api/v1/generations/", {"prompt": "x = 1\n", "max_tokens": 500, "tempreature": 0})
    assert response.status_code == 400, response.content
    body = response.json()
    assert set(body) == {"max_tokens", "tempreature", "status"}
    assert "unknown field" in body["max_tokens"][0] and "max_new_tokens" in body["max_tokens"][0]
    assert not Session.objects.exists()


def test_openai_unknown_fields_are_refused_by_name(client):
    response = post(client, "/v1/completions", {"model": "tiny", "prompt": "x", "max_new_tokens": 5})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_new_tokens"
    response = post(client, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_new_tokens": 5, "tempreature": 0})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "max_new_tokens", error
    assert "max_new_tokens" in error["message"] and "tempreature" in error["message"]
    assert error["code"] == "unknown_parameter" and not Session.objects.exists()
