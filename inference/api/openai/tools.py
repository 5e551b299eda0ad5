"""Tool calls: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as a constraint, and the reply's ``tool_calls``.

The constraint is what makes a call well formed whatever the model: the engine generates output
that follows it, losslessly under speculation (docs/structured-output.md).

* ``tool_choice`` "none" (or no ``tools``): text, no constraint; the tools are not shown to the model;
* a named function (``{"type": "function", "function": {"name": ...}}``): the output is that
  function's arguments, a JSON object following its ``parameters`` (a JSON-schema constraint);
* "auto" (OpenAI's default when tools are given) and "required": an llguidance Lark grammar
  (``grammar``), Hermes/Qwen style. The output is plain text ("auto" only) or call blocks::

      <tool_call>
      {"name":"get_weather","arguments":{"city":"Paris"}}
      </tool_call>

  one or more (``parallel_tool_calls``, default true) separated by a newline, exactly one when it
  is false; each block's JSON is an ``anyOf`` of the tools' ``{"name": const, "arguments":
  parameters}``. The text branch may not contain ``<tool_call>`` anywhere, so whatever has the
  marker is a call the grammar checked: text can never start, or hide, a malformed call. That is
  also what lets a stream decide early: once the output stops being a prefix of the marker it is
  text (streamed as it comes), once it holds the marker it is calls (each sent whole once its
  block is complete).

A named function's call streams its id and name first, then its arguments as they are generated.
A reply cut by ``max_tokens`` before its calls are whole comes back as text (finish reason "length").
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from core.parsers import nesting_depth
from inference.api.openai.errors import bad_param
from inference.engine.constraints import ConstraintError, constraint_from_response_format
from inference.limits import MAX_SCHEMA_DEPTH, MAX_TOOLS_CHARS

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
NO_PARAMETERS = {"type": "object", "properties": {}}

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
CALL_OPEN = "<tool_call>"
CALL_START = CALL_OPEN + "\n"
CALL_END = "\n</tool_call>"
CALL_SEPARATOR = "\n"
# Compact JSON, as response_format's (constraints/grammar.py): no free whitespace to loop on.
COMPACT_JSON = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: str  # the schema as JSON text: a frozen request hashes, and keys keep their order

    def schema(self) -> dict:
        return json.loads(self.parameters)

    def tool(self) -> dict[str, Any]:
        """The OpenAI tool object (what a chat template or the tools prompt shows the model)."""
        function = {"name": self.name, **({"description": self.description} if self.description else {}),
                    "parameters": self.schema()}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCalling:
    """The request's tools and what it asks of them: ``choice`` is NONE, AUTO, REQUIRED or NAMED
    (``named`` then the function's name); ``parallel``: whether AUTO and REQUIRED may call several."""

    functions: tuple[Function, ...]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def calls(self) -> bool:
        """Whether the reply may be a tool call ("none" leaves the output free text)."""
        return self.choice != NONE

    def tools(self) -> list[dict[str, Any]]:
        return [function.tool() for function in self.functions]

    def _function(self, name: str) -> Function:
        return next(function for function in self.functions if function.name == name)

    def response_format(self) -> dict[str, Any] | None:
        """The constraint on the output, as a ``response_format`` the REST API takes (None: free text)."""
        if self.choice == NONE:
            return None
        if self.choice == NAMED:
            return {"type": "json_schema", "json_schema": {"name": self.named,
                                                           "schema": self._function(self.named).schema()}}
        return {"type": "grammar", "grammar": {"syntax": "lark", "definition": self.grammar()}}

    def grammar(self) -> str:
        """The Lark grammar of an "auto" or "required" reply (the module's docstring shows its output)."""
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": function.name},
                                                           "arguments": function.schema()},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for function in self.functions], "x-guidance": COMPACT_JSON}
        rules = [f"start: {'TEXT | ' if self.choice == AUTO else ''}calls",
                 f"calls: call{' (' + json.dumps(CALL_SEPARATOR) + ' call)*' if self.parallel else ''}",
                 f"call: {json.dumps(CALL_START)} call_json {json.dumps(CALL_END)}",
                 f"call_json: %json {json.dumps(call)}"]
        if self.choice == AUTO:
            # any non-empty text without the marker (intersected with /(?s:.*)/: valid UTF-8 only)
            rules.append(f"TEXT: /(?s:.+)/ & ~/(?s:.*){re.escape(CALL_OPEN)}(?s:.*)/")
        return "\n".join(rules) + "\n"

    def parse(self, text: str, session_id: str) -> tuple[list[dict[str, Any]], bool]:
        """The reply's whole tool calls in the generated text, and whether the text is nothing but
        them: no call for a text reply; a generation cut by ``max_tokens`` keeps the calls it
        finished (none: its text is the reply's content). A named function's arguments are the
        text itself, as its stream gave them."""
        if self.choice == NONE:
            return [], False
        if self.choice == NAMED:
            try:
                json.loads(text)
            except ValueError:
                return [], False
            return [call_object(session_id, 0, self.named, text)], True
        blocks = CallBlocks(self, session_id)
        calls = blocks.complete(text)
        return calls, bool(calls) and blocks.end == len(text)


def call_object(session_id: str, index: int, name: str | None, arguments: str) -> dict[str, Any]:
    """One entry of ``tool_calls``: its id (unique in the reply, tied to the session), type and function."""
    return {"id": f"call_{session_id.replace('-', '')[:24]}_{index}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class CallBlocks:
    """The ``<tool_call>`` blocks of an "auto" or "required" output as it grows: the whole calls so far.

    The grammar makes the blocks exact (compact JSON cannot hold a raw newline, so the JSON ends
    where ``CALL_END`` starts); the JSON is read with the standard decoder.
    """

    def __init__(self, tools: ToolCalling, session_id: str) -> None:
        self.names = {function.name for function in tools.functions}
        self.session_id = session_id
        self.end = 0  # where the last whole call ends in the text
        self.calls: list[dict[str, Any]] = []

    def complete(self, text: str) -> list[dict[str, Any]]:
        """The whole calls of ``text`` not returned before (``text`` grows between calls)."""
        found = []
        decoder = json.JSONDecoder()
        while True:
            start = self.end + (len(CALL_SEPARATOR) if self.calls else 0)
            if not text.startswith(CALL_START, start):
                return found
            try:
                value, json_end = decoder.raw_decode(text, start + len(CALL_START))
            except ValueError:
                return found
            if not text.startswith(CALL_END, json_end) or not isinstance(value, dict) \
                    or value.get("name") not in self.names:
                return found
            arguments = json.dumps(value.get("arguments", {}), separators=(",", ":"))
            call = call_object(self.session_id, len(self.calls), value["name"], arguments)
            self.calls.append(call)
            found.append(call)
            self.end = json_end + len(CALL_END)


TEXT, CALLS = "text", "calls"


def output_kind(text: str) -> str | None:
    """What an "auto" or "required" output is so far: CALLS once it holds the marker, TEXT once it
    cannot become it, None while it could still be either (a prefix of the marker)."""
    if text.startswith(CALL_OPEN):
        return CALLS
    return None if CALL_OPEN.startswith(text) else TEXT


class CallStream:
    """What a stream of an "auto" or "required" reply sends as its output grows: the text as it
    comes once the output is text, each call whole once its block is complete."""

    def __init__(self, tools: ToolCalling, session_id: str) -> None:
        self.blocks = CallBlocks(tools, session_id)
        self.kind: str | None = None
        self.sent = 0  # text given out

    def text(self, text: str, final: bool = False) -> str:
        """The new text to send (empty unless the output is text; at the end, a cut call's text
        when no call was whole, as a non-streamed reply gives it)."""
        self.kind = self.kind or output_kind(text)
        if self.kind == CALLS and not (final and not self.blocks.calls):
            return ""
        if self.kind is None and not final:
            return ""
        piece = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return piece

    def calls(self, text: str) -> list[dict[str, Any]]:
        """The calls completed since the last time."""
        self.kind = self.kind or output_kind(text)
        return self.blocks.complete(text) if self.kind == CALLS else []

    def whole(self, text: str) -> bool:
        """Whether the output is nothing but whole calls."""
        return bool(self.blocks.calls) and self.blocks.end == len(text)


def parse_tools(body: dict) -> ToolCalling | None:
    """The request's tool calling, or None when it gives no tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_param("parallel_tool_calls", "'parallel_tool_calls' must be a boolean.", code="invalid_type")
    if tools is None or tools == []:
        if choice not in (None, NONE):
            raise bad_param("tool_choice", "'tool_choice' is only allowed when 'tools' are specified.")
        return None
    if not isinstance(tools, list):
        raise bad_param("tools", "'tools' must be a list of functions.", code="invalid_type")
    _check_size(tools)
    functions = tuple(_function(index, tool) for index, tool in enumerate(tools))
    names = [function.name for function in functions]
    if len(set(names)) != len(names):
        raise bad_param("tools", "function names must be unique.")
    parallel = True if parallel is None else parallel
    if choice is None or choice in (AUTO, REQUIRED, NONE):
        return ToolCalling(functions, choice or AUTO, parallel=parallel)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) \
        and choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if named is None:
        raise bad_param("tool_choice", "'tool_choice' must be 'none', 'auto', 'required', or "
                        "{'type': 'function', 'function': {'name': ...}}.")
    if named not in names:
        raise bad_param("tool_choice.function.name", f"no function named {named!r} in 'tools'.")
    return ToolCalling(functions, NAMED, named, parallel=parallel)


def _check_size(tools: list) -> None:
    """Tools are compiled into one grammar, stored with the session: bounded before either."""
    depth = nesting_depth(tools)
    if depth > MAX_SCHEMA_DEPTH + 1:  # a named call's response_format holds the parameters one level higher
        raise bad_param("tools", f"'tools' must nest at most {MAX_SCHEMA_DEPTH + 1} levels deep; got {depth}.")
    size = len(json.dumps(tools))
    if size > MAX_TOOLS_CHARS:
        raise bad_param("tools", f"'tools' must be at most {MAX_TOOLS_CHARS} characters as JSON; got {size}.")


def _function(index: int, tool: Any) -> Function:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_param(where, f"'{where}' must be {{'type': 'function', 'function': {{...}}}}.")
    function = tool["function"]
    unknown = sorted(set(function) - set(FUNCTION_FIELDS))
    if unknown:
        raise bad_param(f"{where}.function.{unknown[0]}", f"Unrecognized function field: {unknown[0]}",
                        code="unknown_parameter")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad_param(f"{where}.function.name", "a function name is 1-64 letters, digits, '_' or '-'.")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_param(f"{where}.function.description", "a function's description is a string.",
                        code="invalid_type")
    parameters = function.get("parameters", NO_PARAMETERS)
    try:
        constraint_from_response_format({"type": "json_schema", "json_schema": {"name": name, "schema": parameters}},
                                        field=f"{where}.function", remember=False)
    except ConstraintError as error:
        param, message = str(error).split(": ", 1)
        raise bad_param(param.replace(".json_schema.schema", ".parameters"), f"Invalid function parameters: {message}")
    return Function(name, description, json.dumps(parameters))
