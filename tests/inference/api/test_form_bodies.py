"""A form body is held to a JSON body's rules, and what a session stores is bounded.

The REST API parses JSON and forms; a form's ``response_format`` is JSON text, parsed with the JSON
parser's rules (depth, NUL, lone surrogates), so it is a 400 naming the field where it was a
``RecursionError`` 500. A file is refused (no endpoint takes one), any other content type is a 415.
A ``response_format`` is bounded in size and depth before it is compiled or stored, in both APIs.
"""
from __future__ import annotations

import json

import pytest
import redis
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile

from inference.limits import MAX_RESPONSE_FORMAT_CHARS, MAX_SCHEMA_DEPTH, MAX_TOOLS_CHARS
from metadata.models import Session

URL = "/api/v1/generations/"
FORM = "application/x-www-form-urlencoded"


@pytest.fixture(autouse=True)
def empty_cpu_queue():
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    broker.delete("cpu")
    yield
    broker.delete("cpu")


def form(**fields: str) -> str:
    from urllib.parse import urlencode

    return urlencode(fields)


@pytest.mark.django_db
def test_a_form_response_format_nested_50000_deep_is_a_400_naming_it(api_client, tiny_model):
    body = form(prompt="import os\n", response_format="[" * 50_000)
    response = api_client.post(URL, body, content_type=FORM)
    assert response.status_code == 400, response.content
    assert "nested too deeply" in response.json()["response_format"][0]
    assert not Session.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("text, rule", [('{"type": "json\\u0000object"}', "NUL"),
                                        ('{"type": "\\ud800"}', "surrogates")])
def test_a_form_response_format_is_held_to_the_text_rules(api_client, tiny_model, text, rule):
    response = api_client.post(URL, form(prompt="import os\n", response_format=text), content_type=FORM)
    assert response.status_code == 400, response.content
    assert rule in response.json()["response_format"][0]


@pytest.mark.django_db
def test_a_form_field_with_a_nul_is_a_400_naming_it(api_client, tiny_model):
    response = api_client.post(URL, "prompt=import+os%0A&drafter=ngr%00am", content_type=FORM)
    assert response.status_code == 400 and "drafter" in response.json()


@pytest.mark.django_db
def test_a_form_still_makes_a_generation(api_client, tiny_model):
    body = form(prompt="import os\n", max_new_tokens="4", response_format='{"type": "json_object"}')
    response = api_client.post(URL, body, content_type=FORM)
    assert response.status_code == 202, response.content


@pytest.mark.django_db
def test_a_file_is_refused(api_client, tiny_model):
    response = api_client.post(URL, {"prompt": "import os\n", "upload": SimpleUploadedFile("a.txt", b"x" * 100)})
    assert response.status_code == 400 and "takes no uploads" in response.json()["upload"][0]


@pytest.mark.django_db
def test_a_content_type_the_api_does_not_parse_is_a_415(api_client, tiny_model):
    response = api_client.post(URL, "prompt=x", content_type="text/plain")
    assert response.status_code == 415


def wide_schema(chars: int) -> dict:
    properties, size = {}, 0
    while size < chars:
        name = f"field_{len(properties):05d}"
        properties[name] = {"type": "string"}
        size += len(name) + 24
    return {"type": "json_schema", "json_schema": {"name": "wide", "schema": {"type": "object",
                                                                               "properties": properties}}}


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}


@pytest.mark.django_db
def test_a_response_format_past_its_size_is_refused_before_it_is_stored(api_client, tiny_model):
    response_format = wide_schema(MAX_RESPONSE_FORMAT_CHARS + 1000)
    response = api_client.post(URL, {"prompt": "import os\n", "response_format": response_format}, format="json")
    assert response.status_code == 400, response.content
    assert f"at most {MAX_RESPONSE_FORMAT_CHARS} characters" in response.json()["response_format"][0]
    assert not Session.objects.exists()


@pytest.mark.django_db
def test_a_response_format_nested_past_its_depth_is_refused(api_client, tiny_model):
    response = api_client.post(URL, {"prompt": "import os\n", "response_format": deep_schema(MAX_SCHEMA_DEPTH)},
                               format="json")
    assert response.status_code == 400
    assert f"at most {MAX_SCHEMA_DEPTH} levels" in response.json()["response_format"][0]


@pytest.mark.django_db
def test_the_openai_api_bounds_response_format_and_tools(api_client, tiny_model, settings):
    settings.SPECOPS_OPENAI_TIMEOUT_S = 0.05
    wide = wide_schema(MAX_RESPONSE_FORMAT_CHARS + 1000)
    response = api_client.post("/v1/completions", {"model": "tiny", "prompt": "x", "response_format": wide},
                               format="json")
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"
    parameters = wide["json_schema"]["schema"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    response = api_client.post("/v1/chat/completions", {"model": "tiny", "tools": tools,
                                                        "messages": [{"role": "user", "content": "x"}]}, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"] == "tools"
    assert f"at most {MAX_TOOLS_CHARS} characters" in response.json()["error"]["message"]
    assert not Session.objects.exists()


@pytest.mark.django_db
def test_a_stored_response_format_is_within_its_bound(api_client, tiny_model):
    response_format = wide_schema(MAX_RESPONSE_FORMAT_CHARS - 2000)
    response = api_client.post(URL, {"prompt": "import os\n", "response_format": response_format,
                                      "max_new_tokens": 2}, format="json")
    assert response.status_code == 202, response.content
    stored = Session.objects.get().params["response_format"]
    assert json.loads(stored) == response_format and len(stored) <= MAX_RESPONSE_FORMAT_CHARS
