"""Tool calls on /v1/chat/completions: tool_choice "auto", several calls per reply, tool messages.

"auto" and "required" are an llguidance grammar (inference/api/openai/tools.py): plain text that
never holds the call marker, or ``<tool_call>`` blocks whose JSON follows one of the tools. Greedy
speculative output under that grammar is the constrained target's own; with a real worker and
the official `openai` client, every call's arguments validate against its tool's parameters,
streamed or not, from a tiny random model that has never seen a tool. A conversation carries
the calls and their results back into the prompt (the model's chat template, or the fallback).
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from django.test import Client
from rest_framework.authtoken.models import Token
from transformers import AutoTokenizer

from inference.api.openai.chat_template import render_chat
from inference.api.openai.serializers import CHAT, parse_request
from inference.api.openai.tools import AUTO, CALL_OPEN, REQUIRED, CallStream, ToolCalling, parse_tools
from inference.engine import DraftConfig, GenerationConfig, SpeculativeDecoder, build_drafter
from inference.engine.batch.engine import BatchRequest
from inference.engine.constraints import ConstraintError, OutputConstraint, constraint_from_response_format
from inference.engine.decode.target_only import generate_plain
from specops.celery import app
from tests.inference.api.test_hostile_input import HOSTILE
from tests.inference.api.test_validation import assert_nothing_written, empty_cpu_queue  # noqa: F401
from tests.inference.engine.constraint_models import json_tokenizer, models, prompt_ids
from tests.inference.engine.test_constraints_batch import _engine as batched_engine
from tests.worker_process import start_worker, stop_worker

pytest_plugins = ["tests.web_process"]  # live_web, for the client-driven tests

PET = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 30}},
    "required": ["kind", "age"], "additionalProperties": False}
COUNT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_pet", "description": "A pet by kind.", "parameters": PET}},
         {"type": "function", "function": {"name": "count", "parameters": COUNT}}]
PARAMETERS = {"get_pet": PET, "count": COUNT}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_pet", "arguments": '{"kind":"cat","age":3}'}}
HISTORY = [{"role": "user", "content": "Find me a cat."},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"name":"Tom"}'}]


def assert_valid_calls(calls) -> None:
    """Each call names a tool and its arguments validate against that tool's parameters."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    assert len({call.id for call in calls}) == len(calls)


# ---- the grammar and its output, without a server ---------------------------------------------

def test_a_call_in_the_output_is_read_whole_and_a_cut_one_is_text():
    tools = parse_tools({"tools": TOOLS, "tool_choice": "auto"})
    one = '<tool_call>\n{"name":"count","arguments":{"n":3}}\n</tool_call>'
    calls, whole = tools.parse(one + "\n" + one, "0b5e-11")
    assert whole and [c["function"] for c in calls] == [{"name": "count", "arguments": '{"n":3}'}] * 2
    assert calls[0]["id"] != calls[1]["id"]
    cut, whole = tools.parse(one + "\n<tool_call>\n{\"na", "0b5e-11")
    assert cut == calls[:1] and not whole  # cut by max_tokens: the whole call stays, finish reason "length"
    assert tools.parse("<tool_call>\n{\"name\":\"count\",\"argu", "s") == ([], False)
    assert tools.parse("Hello <tool", "s") == ([], False)


def test_a_stream_holds_back_a_possible_marker_then_sends_text_or_whole_calls():
    stream = CallStream(parse_tools({"tools": TOOLS}), "s")
    assert stream.text("<tool") == "" and stream.calls("<tool") == []
    assert stream.text("<tools are") == "<tools are" and stream.text("<tools are nice") == " nice"

    calls = CallStream(parse_tools({"tools": TOOLS}), "s")
    block = '<tool_call>\n{"name":"count","arguments":{"n":3}}\n</tool_call>'
    assert calls.calls(block[:30]) == [] and calls.text(block[:30]) == ""
    assert [c["function"]["name"] for c in calls.calls(block)] == ["count"]
    assert calls.calls(block + "\n<tool_call>\n") == [] and not calls.whole(block + "\n<tool_call>\n")
    assert calls.whole(block) and calls.text(block, final=True) == ""


def test_parallel_tool_calls_false_allows_exactly_one_call():
    one = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert one.choice == REQUIRED and not one.parallel
    assert "call (" not in one.grammar() and "TEXT" not in one.grammar()
    several = parse_tools({"tools": TOOLS})
    assert several.choice == AUTO and "call (" in several.grammar() and "TEXT" in several.grammar()
    # the grammar travels as a response_format the worker reads back
    assert constraint_from_response_format(several.response_format()) == OutputConstraint.lark(several.grammar())


@pytest.mark.parametrize(("value", "path"), [
    ({"type": "grammar"}, "response_format.grammar"),
    ({"type": "grammar", "grammar": {"syntax": "regex", "definition": "a+"}}, "response_format.grammar.syntax"),
    ({"type": "grammar", "grammar": {"definition": ""}}, "response_format.grammar.definition"),
    ({"type": "grammar", "grammar": {"definition": "start: nowhere"}}, "response_format.grammar.definition"),
    ({"type": "grammar", "grammar": {"definition": "start: \"a\"", "lazy": True}}, "response_format.grammar.lazy"),
])
def test_a_grammar_response_format_is_refused_naming_the_field(value, path):
    with pytest.raises(ConstraintError) as refused:
        constraint_from_response_format(value)
    assert str(refused.value).startswith(f"{path}: ")


def _spec_config(tools: ToolCalling, **overrides) -> GenerationConfig:
    return GenerationConfig(eos_token_id=json_tokenizer().eos_token_id,
                            constraint=OutputConstraint.lark(tools.grammar()), **{"max_new_tokens": 64, **overrides})


@pytest.mark.parametrize("fields", [{"tool_choice": "auto"}, {"tool_choice": "required"},
                                    {"tool_choice": "required", "parallel_tool_calls": False}])
@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_greedy_speculative_output_under_the_tool_grammar_equals_the_constrained_target(fields, kind):
    tools = parse_tools({"tools": TOOLS, **fields})
    target, draft, _ = models()
    reference = generate_plain(target, prompt_ids(), _spec_config(tools), tokenizer=json_tokenizer())
    drafter = build_drafter(kind, target=target, draft=draft if kind == "draft_model" else None,
                            config=DraftConfig(tree_width=2, tree_depth=3, node_budget=6))
    result = SpeculativeDecoder(target, drafter, tokenizer=json_tokenizer()).generate(prompt_ids(), _spec_config(tools))
    assert result.token_ids == reference.token_ids
    text = json_tokenizer().decode(result.token_ids, skip_special_tokens=True)
    calls, whole = tools.parse(text, "s")
    if tools.choice == AUTO and not text.startswith(CALL_OPEN):
        assert CALL_OPEN not in text and not calls  # the text branch never holds the marker
    else:
        assert calls and (whole or result.finish_reason == "length")
        assert len(calls) == 1 or tools.parallel
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])


def test_tool_grammar_rows_in_the_batched_engine_equal_their_target_alone():
    target = models()[0]
    rows = [({}, "draft_model"), ({}, "none"), ({"tool_choice": "required"}, "draft_model"),
            ({"tool_choice": "required", "parallel_tool_calls": False}, "none")]
    requests = [BatchRequest((str(fields), kind), prompt_ids(), _spec_config(parse_tools({"tools": TOOLS, **fields})),
                             drafter=kind) for fields, kind in rows]
    results = batched_engine("shared").run(requests, arrivals={requests[2].request_id: 2})
    for request in requests:
        reference = generate_plain(target, prompt_ids(), request.config, tokenizer=json_tokenizer())
        assert results[request.request_id].token_ids == reference.token_ids, request.request_id


def test_sampled_auto_replies_are_text_or_valid_calls():
    tools = parse_tools({"tools": TOOLS})
    target = models()[0]
    kinds = set()
    for seed in range(4):
        config = _spec_config(tools, temperature=1.0, seed=seed, max_new_tokens=60)
        text = json_tokenizer().decode(generate_plain(target, prompt_ids(), config, tokenizer=json_tokenizer())
                                       .token_ids, skip_special_tokens=True)
        calls, _ = tools.parse(text, "s")
        kinds.add("calls" if text.startswith(CALL_OPEN) else "text")
        assert calls or CALL_OPEN not in text
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])
    assert kinds  # either is fine: the model chooses


# ---- the conversation rendered into the prompt ------------------------------------------------

HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>Tools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "Call as <tool_call>{...}</tool_call>\n{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{%- else %}{{ m.content }}{% endif %}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")
PLAIN_TEMPLATE = ("{%- for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                  "{%- if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture
def tokenizer(tiny_model_dirs):
    return AutoTokenizer.from_pretrained(tiny_model_dirs[0])


def _chat(messages, **fields):
    return parse_request({"model": "tiny", "messages": messages, **fields}, CHAT)


def test_the_fallback_describes_the_tools_and_renders_calls_and_results(tokenizer):
    request = _chat(HISTORY, tools=TOOLS)
    assert not getattr(tokenizer, "chat_template", None)
    prompt = render_chat(tokenizer, request.messages, request.calling.tools())
    assert prompt.startswith("### System:\n") and '"name": "get_pet"' in prompt and "<tools>" in prompt
    assert '<tool_call>\n{"name":"get_pet","arguments":{"kind":"cat","age":3}}\n</tool_call>' in prompt
    assert '### User:\n<tool_response>\n{"name":"Tom"}\n</tool_response>' in prompt
    assert prompt.endswith("### Assistant:\n")
    assert "<tools>" not in render_chat(tokenizer, request.messages, None)  # tool_choice "none": no tools shown

    tokenizer.chat_template = PLAIN_TEMPLATE  # a template that knows no tools: the same rewrite, its format
    templated = render_chat(tokenizer, request.messages, request.calling.tools())
    assert templated.startswith("[system] You may call") and "[user] <tool_response>" in templated


def test_a_template_that_knows_tools_renders_them_itself(tokenizer):
    tokenizer.chat_template = HERMES_TEMPLATE
    request = _chat(HISTORY, tools=TOOLS)
    prompt = render_chat(tokenizer, request.messages, request.calling.tools())
    assert prompt.startswith("<|system|>Tools:") and '"name": "count"' in prompt
    # the template got the call's arguments as an object, and the tool message as it is
    assert '<|assistant|><tool_call>get_pet{"kind": "cat", "age": 3}</tool_call>' in prompt
    assert '<|tool|>{"name":"Tom"}' in prompt and prompt.endswith("<|assistant|>")


# ---- refusals, through the API ----------------------------------------------------------------

BAD_HISTORY = [
    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_9", "content": "r"}],
     "messages[1].tool_call_id"),
    ([*HISTORY[:2], {"role": "tool", "tool_call_id": "nope", "content": "r"}], "messages[2].tool_call_id"),
    ([{"role": "tool", "tool_call_id": "call_1", "content": "r"}, *HISTORY], "messages[0].tool_call_id"),
    ([HISTORY[0], {"role": "tool", "content": "r"}], "messages[1].tool_call_id"),
    ([HISTORY[0], {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([HISTORY[0], {"role": "assistant", "tool_calls": [{"type": "function", "function": CALL["function"]}]}],
     "messages[1].tool_calls[0].id"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[0].tool_calls"),
    ([HISTORY[0], {"role": "assistant", "content": None}], "messages[1].content"),
]


@pytest.mark.django_db
@pytest.mark.parametrize("messages, param", BAD_HISTORY)
def test_a_tool_message_must_answer_an_earlier_call(api_user, tiny_model, messages, param):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {Token.objects.create(user=api_user).key}")
    body = {"model": "tiny", "messages": messages, "tools": TOOLS}
    response = client.post("/v1/chat/completions", json.dumps(body), content_type="application/json")
    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"] == param, response.json()
    assert_nothing_written()


@pytest.mark.django_db
def test_hostile_values_in_tools_and_tool_messages_are_never_a_server_error(api_user, tiny_model, settings):
    settings.SPECOPS_OPENAI_TIMEOUT_S = 0.05  # no worker runs: a valid request's wait ends at once
    client = Client(HTTP_AUTHORIZATION=f"Bearer {Token.objects.create(user=api_user).key}")
    failed = []
    for value in HOSTILE:
        for body in (
            {"messages": [HISTORY[0], {"role": "assistant", "content": value, "tool_calls": [CALL]}]},
            {"messages": [HISTORY[0], {"role": "assistant", "tool_calls": value}]},
            {"messages": [HISTORY[0], {"role": "assistant", "tool_calls": [value]}]},
            {"messages": [HISTORY[0], {"role": "assistant", "tool_calls": [{**CALL, "id": value}]}]},
            {"messages": [HISTORY[0], {"role": "assistant", "tool_calls": [
                {**CALL, "function": {"name": value, "arguments": "{}"}}]}]},
            {"messages": [HISTORY[0], {"role": "assistant", "tool_calls": [
                {**CALL, "function": {"name": "f", "arguments": json.dumps({"a": value})}}]}]},
            {"messages": [*HISTORY[:2], {"role": "tool", "tool_call_id": value, "content": "r"}]},
            {"messages": [*HISTORY[:2], {"role": "tool", "tool_call_id": "call_1", "content": value}]},
            {"messages": HISTORY, "tools": [{"type": "function", "function": {"name": "f", "description": value}}]},
        ):
            response = client.post("/v1/chat/completions", json.dumps({"model": "tiny", "max_tokens": 2, "tools": TOOLS,
                                                                       **body}), content_type="application/json")
            if response.status_code >= 500 and not (response.status_code == 504 and b'"timeout"' in response.content):
                failed.append(f"{body!r}: {response.status_code} {response.content[:200]!r}")
    assert not failed


# ---- the official client against the live server and a real worker ------------------------------

@pytest.fixture(scope="module")
def cpu_worker(django_db_setup, tmp_path_factory):
    app.control.purge()
    process = start_worker("cpu", "tools-cpu", tmp_path_factory.mktemp("worker") / "worker.log")
    yield process
    stop_worker(process)


@pytest.fixture
def client(live_web, api_user) -> openai.OpenAI:
    token = Token.objects.create(user=api_user).key
    return openai.OpenAI(base_url=f"{live_web.url}/v1", api_key=token, max_retries=0, timeout=120)


def _streamed(chunks) -> tuple[str, list, str]:
    """(content, tool calls, finish reason) of a stream whose calls each come whole."""
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [call for c in chunks if c.choices and c.choices[0].delta.tool_calls for call in c.choices[0].delta.tool_calls]
    assert [call.index for call in calls] == list(range(len(calls)))
    return content, [call for call in calls], chunks[-1].choices[0].finish_reason


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_openai_client_gets_text_or_valid_calls_with_auto(client, tiny_model, cpu_worker):
    messages = [{"role": "user", "content": "Find me a pet."}]
    for seed in (1, 2):
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=1.0,
                                               seed=seed, tools=TOOLS)
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert_valid_calls(choice.message.tool_calls)
        else:
            assert choice.message.content and CALL_OPEN not in choice.message.content

        content, calls, finish = _streamed(list(client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=60, temperature=1.0, seed=seed, tools=TOOLS, stream=True)))
        if calls:  # the same generation (same seed): the same calls, whole in their chunks
            assert finish == "tool_calls" and not content
            assert [(c.function.name, c.function.arguments) for c in calls] == \
                [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        else:
            assert content == choice.message.content and finish == choice.finish_reason


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_openai_client_gets_one_or_several_calls_and_continues_the_conversation(client, tiny_model, cpu_worker):
    messages = [{"role": "user", "content": "Find me two pets."}]
    several = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, temperature=0,
                                             tools=TOOLS, tool_choice="required")
    if several.choices[0].finish_reason == "tool_calls":
        assert_valid_calls(several.choices[0].message.tool_calls)
    _, streamed, finish = _streamed(list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=64, temperature=0, tools=TOOLS, tool_choice="required",
        stream=True)))  # the same greedy generation: the same calls, each whole in its chunk, indexed
    assert finish == several.choices[0].finish_reason
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in several.choices[0].message.tool_calls or []]
    one = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, temperature=0,
                                         tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1
    assert_valid_calls(one.choices[0].message.tool_calls)
    _, streamed, finish = _streamed(list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=64, temperature=0, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, stream=True)))
    assert finish == "tool_calls" and [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in one.choices[0].message.tool_calls]

    call = one.choices[0].message.tool_calls[0]
    history = [*messages, one.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "none left"}]
    after = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0, tools=TOOLS)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")

    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(model="tiny", max_tokens=8, tools=TOOLS, messages=[
            *history[:2], {"role": "tool", "tool_call_id": "call_nope", "content": "x"}])
    assert unknown.value.body["param"] == "messages[2].tool_call_id"
