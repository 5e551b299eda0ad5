"""Compiling a request's schemas: off the event loop, bounded in time, cached by digest, and only
for requests that were accepted.

``/v1/`` parses its body (compiling ``response_format`` and each tool's parameters with llguidance)
on a pool of its own, not on the event loop that sends every stream of the process, under a
wall-clock backstop. The cache of compiled constraints (``checked_constraints``) is keyed by a
SHA-256 digest and bounded in bytes, and a request that is refused after its schema compiled
(another field, the tenant's quota) leaves nothing in it.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
import redis
from django.conf import settings

from inference.api.openai import submission as openai_submission
from inference.engine.constraints import ConstraintError, OutputConstraint
from inference.engine.constraints import grammar, response_format
from inference.engine.constraints.grammar import CheckedConstraints, check_constraint, constraint_digest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def json_schema(name: str, schema: dict = SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


@pytest.fixture(autouse=True)
def empty_cpu_queue_and_cache():
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    broker.delete("cpu")
    grammar.checked_constraints.clear()
    yield
    broker.delete("cpu")
    grammar.checked_constraints.clear()


@pytest.fixture
def compiles(monkeypatch) -> list[bool]:
    """Whether each compile of a response_format ran on a thread with a running event loop."""
    on_loop: list[bool] = []
    real = response_format.check_constraint

    def recording(constraint, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real(constraint, **kwargs)

    monkeypatch.setattr(response_format, "check_constraint", recording)
    return on_loop


def completion(name: str = "city", **extra) -> dict:
    return {"model": "tiny", "prompt": "Where?", "max_tokens": 2, "response_format": json_schema(name), **extra}


@pytest.mark.django_db
def test_an_openai_requests_schema_is_compiled_off_the_event_loop(api_client, tiny_model, compiles, settings):
    settings.SPECOPS_OPENAI_TIMEOUT_S = 0.05  # no worker: the reply's wait ends at once (504)
    response = api_client.post("/v1/completions", completion(), format="json")
    assert response.status_code == 504, response.content
    assert compiles and not any(compiles), compiles


@pytest.mark.django_db
def test_a_compile_past_the_wall_clock_limit_is_a_503(api_client, tiny_model, monkeypatch):
    monkeypatch.setattr(openai_submission, "PARSE_TIMEOUT_S", 0.2)
    release = threading.Event()

    def slow(constraint, **kwargs):
        release.wait(5)

    monkeypatch.setattr(response_format, "check_constraint", slow)
    try:
        response = api_client.post("/v1/completions", completion(), format="json")
    finally:
        release.set()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "compile_timeout" and response["Retry-After"]


@pytest.mark.django_db
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {**completion("refused"), "top_p": 7}),  # a later field is refused
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "nobody", "content": "x"}],
                              "response_format": json_schema("refused")}),
    ("/api/v1/generations/", {"prompt": "x", "max_new_tokens": 100_000, "response_format": json_schema("refused")}),
])
def test_a_refused_request_leaves_nothing_in_the_cache(api_client, tiny_model, path, body):
    response = api_client.post(path, body, format="json")
    assert response.status_code == 400, response.content
    constraint = OutputConstraint.json_schema(SCHEMA)
    assert constraint_digest(constraint) not in grammar.checked_constraints
    assert grammar.checked_constraints.bytes == 0


@pytest.mark.django_db
def test_a_refused_tool_request_leaves_nothing_in_the_cache(api_client, tiny_model, settings):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}]
    response = api_client.post("/v1/chat/completions", {"model": "tiny", "tools": tools, "top_p": 9,
                                                        "messages": [{"role": "user", "content": "x"}]}, format="json")
    assert response.status_code == 400
    assert grammar.checked_constraints.bytes == 0


@pytest.mark.django_db
def test_an_accepted_request_is_remembered_by_digest(api_client, tiny_model, compiles):
    body = {"prompt": "x", "max_new_tokens": 2, "response_format": json_schema("city")}
    assert api_client.post("/api/v1/generations/", body, format="json").status_code == 202
    assert constraint_digest(OutputConstraint.json_schema(SCHEMA)) in grammar.checked_constraints
    compiled = len(compiles)
    assert api_client.post("/api/v1/generations/", body, format="json").status_code == 202
    assert len(compiles) == compiled + 1  # asked again, answered from the cache: no second compile
    assert grammar.checked_constraints.bytes > 0


def test_the_cache_holds_digests_within_its_bytes():
    cache = CheckedConstraints(max_bytes=10_000)
    big = OutputConstraint.json_schema({"type": "object", "description": "x" * 500_000})
    cache.add(constraint_digest(big))
    assert cache.bytes < 1000  # a digest, not the schema's half megabyte
    for number in range(1000):
        cache.add(constraint_digest(OutputConstraint.json_schema({"type": "object", "title": str(number)})))
    assert cache.bytes <= 10_000
    assert constraint_digest(big) not in cache  # the least recently used went first


def test_a_check_without_remembering_compiles_and_leaves_nothing():
    constraint = OutputConstraint.json_schema({"type": "object", "title": "unremembered"})
    check_constraint(constraint, remember=False)
    assert constraint_digest(constraint) not in grammar.checked_constraints
    check_constraint(constraint)
    assert constraint_digest(constraint) in grammar.checked_constraints


@pytest.mark.parametrize("limit, message", [("max_grammar_size", "grammar size"),
                                              ("initial_lexer_fuel", "initial lexer configuration")])
def test_compiling_is_held_to_the_engines_limits(monkeypatch, limit, message):
    monkeypatch.setitem(grammar.COMPILE_LIMITS, limit, 100)
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": "[a-z]{1,8}"} for i in range(50)}}
    with pytest.raises(ConstraintError, match=message):
        check_constraint(OutputConstraint.json_schema(schema))
