"""Validate an OpenAI request body and translate it into SpecOps's generation request.

Checks here are the protocol's own (types, what this server does not support, unknown fields);
everything about the model — its name, the prompt's length against its context, the drafter —
is left to ``GenerationRequestSerializer``, so both APIs accept exactly the same generations.
Every refusal is an ``OpenAIError`` (400) whose ``param`` names the field.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inference.api.openai.errors import OpenAIError, bad_param, unsupported
from inference.api.openai.tools import ToolCalling, parse_tools
from inference.api.serializers import response_format_rule
from inference.engine.config import GenerationConfig
from inference.engine.constraints import ConstraintError, OutputConstraint, constraint_from_response_format
from inference.limits import (
    MAX_STOP_SEQUENCES,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    OPENAI_MAX_TEMPERATURE,
    TOP_P_RULE,
    temperature_rule,
)

COMPLETION = "completion"
CHAT = "chat"

# OpenAI's defaults where they differ from SpecOps's (``GenerationConfig``): the legacy completions
# endpoint's max_tokens (chat completions leave it to SpecOps's default) and the temperature.
COMPLETION_DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
CHAT_ROLES = ("system", "developer", "user", "assistant")
TOOL_ROLE = "tool"  # a tool's result: with a ``tool_call_id`` (not in CHAT_ROLES: schema.py's fuzzing has none)
MESSAGES = "messages"


def _is_absent(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == [] or value is False


def _zero(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)


def _one(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value == 1)


def _text_modality(value: Any) -> bool:
    return value is None or value == ["text"]


def _no_tool_choice(value: Any) -> bool:
    return value is None or value == "none"


# Fields of OpenAI's protocol that this server does not implement: accepted only at the value
# that means "off" (what the official client sends when the caller does not set them).
UNSUPPORTED_COMMON: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_one, "one choice per request"),
    "logit_bias": (_empty, "no logit bias"),
    "presence_penalty": (_zero, "no presence penalty"),
    "frequency_penalty": (_zero, "no frequency penalty"),
}
UNSUPPORTED_COMPLETION = {
    **UNSUPPORTED_COMMON,
    "logprobs": (_is_absent, "no log probabilities"),
    "echo": (_empty, "the prompt is not echoed"),
    "best_of": (_one, "one candidate per request"),
    "suffix": (_is_absent, "no insertion"),
}
UNSUPPORTED_CHAT = {
    **UNSUPPORTED_COMMON,
    "logprobs": (_empty, "no log probabilities"),
    "top_logprobs": (_is_absent, "no log probabilities"),
    "functions": (_empty, "no function calls"),
    "function_call": (_no_tool_choice, "no function calls"),
    "modalities": (_text_modality, "text only"),
    "audio": (_is_absent, "text only"),
    "prediction": (_is_absent, "no predicted outputs"),
    "web_search_options": (_is_absent, "no web search"),
    "reasoning_effort": (_is_absent, "no reasoning models"),
}
# Accepted and ignored: bookkeeping fields that do not change the generation.
IGNORED = ("user", "metadata", "store", "service_tier")
COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
                 "drafter", "top_k", "response_format")


@dataclass(frozen=True)
class OpenAIRequest:
    """A validated OpenAI request; ``generation_data`` turns it into SpecOps's request."""

    kind: str
    model: str
    prompt: str | None = None  # completions
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat completions (_message)
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = GenerationConfig.top_p
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_k: int | None = None
    drafter: str | None = None
    stream: bool = False
    include_usage: bool = False
    # a JSON object or a JSON schema the reply must follow (None: text), as the client sent it
    response_format: dict[str, Any] | None = None
    tools: ToolCalling | None = None  # chat: the request's tools and tool_choice (tools.py)

    @property
    def calling(self) -> ToolCalling | None:
        """The tool calling the reply may make: None without tools or with tool_choice "none"."""
        return self.tools if self.tools is not None and self.tools.calls else None

    def generation_data(self, prompt: str) -> dict[str, Any]:
        """The body of a ``POST /api/v1/generations/`` for this request, with ``prompt`` rendered."""
        data: dict[str, Any] = {"prompt": prompt, "model": self.model, "temperature": self.temperature,
                                "top_p": self.top_p, "stop": self.stop}
        optional = {"max_new_tokens": self.max_tokens, "seed": self.seed, "top_k": self.top_k,
                    "drafter": self.drafter,
                    "response_format": self.calling.response_format() if self.calling else self.response_format}
        data.update({key: value for key, value in optional.items() if value is not None})
        return data

    def checked_constraints(self) -> tuple[OutputConstraint, ...]:
        """The constraints parsing compiled (not remembered until the request is accepted):
        ``response_format``'s and each tool's parameters'."""
        checked = [constraint_from_response_format(self.response_format, compile=False)] if self.response_format else []
        if self.tools is not None:
            checked += [OutputConstraint.json_schema(function.schema()) for function in self.tools.functions]
        return tuple(constraint for constraint in checked if constraint is not None)

    def param_of(self, generation_field: str) -> str:
        """The OpenAI name of a GenerationRequestSerializer field (for error messages)."""
        if generation_field == "max_new_tokens":
            return self.max_tokens_param
        if generation_field == "prompt":
            return "prompt" if self.kind == COMPLETION else "messages"
        return generation_field


def parse_request(body: Any, kind: str) -> OpenAIRequest:
    """Validate the body of ``POST /v1/completions`` (kind COMPLETION) or ``/v1/chat/completions``."""
    if not isinstance(body, dict):
        raise bad_param(None, "request body: expected a JSON object.", code="invalid_body")
    specific = ("prompt",) if kind == COMPLETION else ("messages", "max_completion_tokens", "tools", "tool_choice",
                                                       "parallel_tool_calls")
    unsupported_fields = UNSUPPORTED_COMPLETION if kind == COMPLETION else UNSUPPORTED_CHAT
    unknown = [name for name in body if name not in unsupported_fields and name not in COMMON_FIELDS
               and name not in specific and name not in IGNORED]
    if unknown:  # every one named (as OpenAI does), ``param`` the first
        plural = "s" if len(unknown) > 1 else ""
        raise bad_param(unknown[0], f"Unrecognized request argument{plural} supplied: {', '.join(unknown)}",
                        code="unknown_parameter")
    for name, value in body.items():
        if name in unsupported_fields:
            accepts, meaning = unsupported_fields[name]
            if not accepts(value):
                raise unsupported(name, meaning)

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_param("model", "you must provide a model parameter (a model name from GET /v1/models).",
                        code="missing_required_parameter" if model is None else "invalid_type")
    stream = _optional(body, "stream", bool) or False
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad_param("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled.")
    include_usage = _stream_options(options)
    max_tokens, max_tokens_param = _max_tokens(body, kind)
    common = {
        "kind": kind, "model": model, "max_tokens": max_tokens, "max_tokens_param": max_tokens_param,
        "temperature": _temperature(body), "top_p": _top_p(body),
        "seed": _optional(body, "seed", int), "stop": _stop(body.get("stop")), "top_k": _optional(body, "top_k", int),
        "drafter": _optional(body, "drafter", str), "stream": stream, "include_usage": include_usage,
        "response_format": _response_format(body.get("response_format")),
    }
    if kind == COMPLETION:
        return OpenAIRequest(prompt=_prompt(body.get("prompt")), **common)
    tools = parse_tools(body)
    if tools is not None and tools.calls and common["response_format"] is not None:
        raise bad_param("response_format", "'response_format' cannot be combined with a tool call; set "
                        "'tool_choice' to 'none' for a structured reply.")
    return OpenAIRequest(messages=_messages(body.get("messages")), tools=tools, **common)


def _response_format(value: Any) -> dict[str, Any] | None:
    """The response format to pass on (None for text); one too large or nested too deeply, or a
    schema the engine cannot compile, is a 400 (compiled, not yet remembered: ``checked_constraints``)."""
    if value is None:
        return None
    rule = response_format_rule(value)
    if rule:
        raise bad_param("response_format", f"'response_format' {rule}")
    try:
        constraint = constraint_from_response_format(value, remember=False)
    except ConstraintError as error:
        param = str(error).split(":", 1)[0]
        raise bad_param(param, f"Invalid '{param}': {str(error).split(': ', 1)[1]}") from None
    return value if constraint is not None else None


def _optional(body: dict, name: str, kind: type) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad_param(name, f"'{name}' must be {'an integer' if kind is int else f'a {kind.__name__}'}.",
                        code="invalid_type")
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_param(name, f"'{name}' must be a number.", code="invalid_type")
    if not low <= value <= high:
        raise bad_param(name, f"'{name}' must be between {low:g} and {high:g}; got {_show(value)}.")
    return float(value)


def _show(value: float) -> str:
    """A number for a message (an int too large for a float is shown by its size)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {len(str(abs(value)))} digits"
    return f"{value:g}"


def _temperature(body: dict) -> float:
    value = _number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, OPENAI_MAX_TEMPERATURE)
    if 0.0 < value < MIN_TEMPERATURE:
        raise bad_param("temperature", f"'temperature' {temperature_rule(OPENAI_MAX_TEMPERATURE)}; got {value:g}.")
    return value


def _top_p(body: dict) -> float:
    value = _number(body, "top_p", GenerationConfig.top_p, 0.0, 1.0)
    if value < MIN_TOP_P:
        raise bad_param("top_p", f"'top_p' {TOP_P_RULE}; got {value:g}.")
    return value


def _max_tokens(body: dict, kind: str) -> tuple[int | None, str]:
    name = "max_completion_tokens" if kind == CHAT and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    value = _optional(body, name, int)
    if value is not None and value < 1:
        raise bad_param(name, f"'{name}' must be at least 1; got {value}.")
    if value is None and kind == COMPLETION:
        value = COMPLETION_DEFAULT_MAX_TOKENS
    return value, name


def _stream_options(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_param("stream_options", "'stream_options' must be an object.", code="invalid_type")
    unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})
    if unknown:
        raise bad_param(f"stream_options.{unknown[0]}", f"Unrecognized stream option: {unknown[0]}",
                        code="unknown_parameter")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_param("stream_options.include_usage", "'include_usage' must be a boolean.", code="invalid_type")
    return include


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_param("stop", "'stop' must be a string or a list of strings.", code="invalid_type")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_param("stop", f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences; got {len(stops)}.")
    if any(not s for s in stops):
        raise bad_param("stop", "'stop' sequences must not be empty.")
    return stops


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        return value
    if value is None:
        raise bad_param("prompt", "you must provide a prompt.", code="missing_required_parameter")
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        raise unsupported("prompt", "one prompt per request, not a list of prompts")
    raise unsupported("prompt", "a string; token-id prompts are not supported")


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise bad_param("messages", "you must provide messages.", code="missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise bad_param("messages", "'messages' must be a non-empty list of messages.", code="invalid_type")
    messages = [_message(index, message) for index, message in enumerate(value)]
    _check_tool_results(messages)
    return messages


def _message(index: int, message: Any) -> dict[str, Any]:
    """A message as the prompt renders it (chat_template.py): role and text content, an
    assistant's ``tool_calls`` (content then may be null), a tool result's ``tool_call_id``."""
    where = f"{MESSAGES}[{index}]"
    if not isinstance(message, dict):
        raise bad_param(where, f"'{where}' must be an object with 'role' and 'content'.", code="invalid_type")
    role = message.get("role")
    if role == "function" or message.get("function_call"):
        raise unsupported(f"{where}.role" if role == "function" else f"{where}.function_call",
                          "the deprecated function calls; use tools")
    if role == TOOL_ROLE:
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_param(f"{where}.tool_call_id", f"'{where}.tool_call_id' must be the id of the call it answers.",
                            code="missing_required_parameter" if call_id is None else "invalid_type")
        return {"role": role, "tool_call_id": call_id, "content": _content(f"{where}.content", message.get("content"))}
    if role not in CHAT_ROLES:
        raise bad_param(f"{where}.role", f"'{where}.role' must be one of {', '.join(CHAT_ROLES + (TOOL_ROLE,))}; "
                        f"got {role!r}.")
    calls = message.get("tool_calls")
    if calls is not None and calls != []:
        if role != "assistant":
            raise bad_param(f"{where}.tool_calls", "only an assistant message has 'tool_calls'.")
        if not isinstance(calls, list):
            raise bad_param(f"{where}.tool_calls", f"'{where}.tool_calls' must be a list of calls.",
                            code="invalid_type")
        content = message.get("content")
        return {"role": role, "content": None if content is None else _content(f"{where}.content", content),
                "tool_calls": [_tool_call(f"{where}.tool_calls[{number}]", call) for number, call in enumerate(calls)]}
    return {"role": role, "content": _content(f"{where}.content", message.get("content"))}


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    """One call of an assistant message, as this server's replies give them (arguments: JSON text)."""
    if not isinstance(call, dict) or call.get("type", "function") != "function" \
            or not isinstance(call.get("function"), dict):
        raise bad_param(where, f"'{where}' must be {{'id': ..., 'type': 'function', 'function': {{'name', "
                        "'arguments'}}}}.", code="invalid_type")
    call_id, function = call.get("id"), call["function"]
    if not isinstance(call_id, str) or not call_id:
        raise bad_param(f"{where}.id", f"'{where}.id' must be a non-empty string.", code="invalid_type")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        raise bad_param(f"{where}.function.name", "a call names its function.", code="invalid_type")
    if not isinstance(arguments, str):
        raise bad_param(f"{where}.function.arguments", "a call's arguments are a JSON object, as a string.",
                        code="invalid_type")
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the decoder goes
        parsed = None
    if not isinstance(parsed, dict):
        raise bad_param(f"{where}.function.arguments", "a call's arguments are a JSON object, as a string.")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _check_tool_results(messages: list[dict[str, Any]]) -> None:
    """A tool message answers a call of an earlier assistant message, by its id."""
    called: set[str] = set()
    for index, message in enumerate(messages):
        called.update(call["id"] for call in message.get("tool_calls") or ())
        if message["role"] == TOOL_ROLE and message["tool_call_id"] not in called:
            param = f"{MESSAGES}[{index}].tool_call_id"
            raise bad_param(param, f"'{param}' ({message['tool_call_id']!r}) answers no tool call of an earlier "
                            "assistant message.")


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for number, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise unsupported(f"{where}[{number}]", "text content parts only")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_param(where, f"'{where}' must be a string or a list of text parts.", code="invalid_type")


def generation_error(errors: dict, request: OpenAIRequest) -> OpenAIError:
    """The OpenAI error for the first field GenerationRequestSerializer refused."""
    name, messages = next(iter(errors.items()))
    message = " ".join(str(m) for m in messages) if isinstance(messages, list) else str(messages)
    param = None if name == "non_field_errors" else request.param_of(name)
    if name == "model":
        return OpenAIError(404, f"The model '{request.model}' does not exist or is not active: {message}",
                           param="model", code="model_not_found")
    code = "context_length_exceeded" if "accepts at most" in message else "invalid_value"
    return OpenAIError(400, f"{param}: {message}" if param else message, param=param, code=code)
