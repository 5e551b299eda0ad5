"""Structured output through both APIs: `response_format` (JSON mode and JSON schema), and tool calls.

A format the engine cannot compile is a 400 naming the field, with nothing written or
enqueued; an accepted one is stored on the session and read back by the worker as the engine's
constraint; with a real worker and the official `openai` client, replies (streamed too) parse
and validate against their schema, from a tiny random model that has never seen JSON.
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from django.test import Client
from rest_framework.authtoken.models import Token

from inference.engine.constraints import OutputConstraint
from inference.worker.session_params import generation_config
from metadata.models import Session
from specops.celery import app
from tests.inference.api.test_validation import assert_nothing_written, empty_cpu_queue  # noqa: F401
from tests.worker_process import start_worker, stop_worker

pytest_plugins = ["tests.web_process"]  # live_web, for the client-driven tests

URL = "/api/v1/generations/"
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "name": {"type": "string", "maxLength": 4}},
    "required": ["kind", "age", "name"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
BAD_FORMATS = [
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "pet", "schema": {"type": "nonsense"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_object", "schema": {}}, "response_format.schema"),
    ("json", "response_format"),
]


@pytest.mark.django_db
@pytest.mark.parametrize("response_format, path", BAD_FORMATS)
def test_rest_refuses_a_format_naming_the_field_and_writes_nothing(api_client, tiny_model, response_format, path):
    body = {"prompt": "x", "response_format": response_format}
    response = api_client.generic("POST", URL, json.dumps(body), content_type="application/json")
    assert response.status_code == 400, response.content
    assert f"{path}: " in json.dumps(response.json()["response_format"])
    assert_nothing_written()


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("response_format, param", BAD_FORMATS)
def test_openai_refuses_a_format_naming_the_param_and_writes_nothing(api_user, tiny_model, path, response_format,
                                                                    param):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {Token.objects.create(user=api_user).key}")
    body = {"model": "tiny", "response_format": response_format,
            **({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})}
    response = client.post(path, json.dumps(body), content_type="application/json")
    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"] == param, response.json()
    assert_nothing_written()


TOOL = {"type": "function", "function": {"name": "get_pet", "description": "A pet by kind.", "parameters": SCHEMA}}
OTHER_TOOL = {"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
    "additionalProperties": False}}}
BAD_TOOLS = [
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [TOOL, TOOL], "tool_choice": "required"}, "tools"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.django_db
@pytest.mark.parametrize("fields, param", BAD_TOOLS)
def test_openai_refuses_a_tool_call_it_cannot_make_naming_the_param(api_user, tiny_model, fields, param):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {Token.objects.create(user=api_user).key}")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], **fields}
    response = client.post("/v1/chat/completions", json.dumps(body), content_type="application/json")
    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"] == param, response.json()
    assert_nothing_written()


@pytest.mark.django_db
def test_rest_stores_the_format_and_the_worker_reads_it_as_the_constraint(api_client, tiny_model):
    response = api_client.post(URL, {"prompt": "pet: ", "response_format": JSON_SCHEMA}, format="json")
    assert response.status_code == 202, response.content
    session = Session.objects.get()
    # stored as JSON text, so the schema's properties keep their order (jsonb would sort them)
    assert json.loads(session.params["response_format"]) == JSON_SCHEMA
    assert generation_config(session.params, 0).constraint == OutputConstraint.json_schema(SCHEMA)

    text = api_client.post(URL, {"prompt": "pet: ", "response_format": {"type": "text"}}, format="json")
    assert text.status_code == 202, text.content
    plain = Session.objects.get(pk=text.json()["id"])
    assert "response_format" not in plain.params and generation_config(plain.params, 0).constraint is None


# ---- the official client against the live server and a real worker ------------------------------

@pytest.fixture(scope="module")
def cpu_worker(django_db_setup, tmp_path_factory):
    app.control.purge()
    process = start_worker("cpu", "structured-cpu", tmp_path_factory.mktemp("worker") / "worker.log")
    yield process
    stop_worker(process)


@pytest.fixture
def client(live_web, api_user) -> openai.OpenAI:
    token = Token.objects.create(user=api_user).key
    return openai.OpenAI(base_url=f"{live_web.url}/v1", api_key=token, max_retries=0, timeout=120)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_openai_client_gets_valid_json_streamed_or_not(client, tiny_model, cpu_worker):
    messages = [{"role": "user", "content": "Describe a pet."}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                           response_format=JSON_SCHEMA)
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0.8,
                                                 seed=3, response_format=JSON_SCHEMA, stream=True))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), SCHEMA)

    completion = client.completions.create(model="tiny", prompt="pet: ", max_tokens=60, temperature=0,
                                           extra_body={"response_format": JSON_SCHEMA})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_openai_client_gets_tool_calls_streamed_or_not(client, tiny_model, cpu_worker):
    messages = [{"role": "user", "content": "Find me a pet."}]
    named = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                           tools=[TOOL, OTHER_TOOL],
                                           tool_choice={"type": "function", "function": {"name": "get_pet"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_pet" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)

    streamed_named = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=60, temperature=0, tools=[TOOL, OTHER_TOOL], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_pet"}}))
    deltas = [c.choices[0].delta.tool_calls[0] for c in streamed_named if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_pet"  # before any argument
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert streamed_named[-1].choices[0].finish_reason == "tool_calls"

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                                 tools=[TOOL, OTHER_TOOL], tool_choice="required", stream=True,
                                                 parallel_tool_calls=False))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed = calls[0][0].function
    jsonschema.validate(json.loads(streamed.arguments),
                        SCHEMA if streamed.name == "get_pet" else OTHER_TOOL["function"]["parameters"])
