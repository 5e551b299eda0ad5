"""Tool calls: ``tools`` and ``tool_choice`` as a JSON-schema constraint, and the reply's ``tool_calls``.

The constraint is what makes a call well formed whatever the model: the engine generates JSON
that follows it, losslessly under speculation (docs/structured-output.md).

* ``tool_choice`` "none" (or no ``tools``): text, the tools unused;
* a named function (``{"type": "function", "function": {"name": ...}}``): the output is that
  function's arguments, a JSON object following its ``parameters``;
* "required": the output is ``{"name": ..., "arguments": {...}}`` for one of the tools (an
  ``anyOf`` of them), split into the call;
* "auto" (OpenAI's default when tools are given) is refused: choosing between text and a call is
  the model's own skill, which a grammar cannot give a model that was never trained for it; name
  the function or use "required".

One call per reply (``parallel_tool_calls`` is accepted either way). A named function's call
streams: its id and name first, then its arguments as they are generated; a "required" call comes
whole once generated (its name is part of the output). Tool messages in the conversation are not
supported.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from inference.api.openai.errors import bad_param, unsupported
from inference.engine.constraints import ConstraintError, constraint_from_response_format

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCalling:
    """The request's tools, (name, parameters schema) each, and the function it must call (None: any)."""

    functions: tuple[tuple[str, str], ...]  # the schemas as JSON text: a frozen request hashes
    choice: str | None

    def _parameters(self, name: str) -> dict:
        return json.loads(dict(self.functions)[name])

    def response_format(self) -> dict[str, Any]:
        """The constraint on the output, as a ``response_format`` the REST API takes."""
        if self.choice is not None:
            schema = self._parameters(self.choice)
        else:
            schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": name},
                                                                 "arguments": self._parameters(name)},
                                 "required": ["name", "arguments"], "additionalProperties": False}
                                for name, _ in self.functions]}
        return {"type": "json_schema", "json_schema": {"name": self.choice or "tool_call", "schema": schema}}

    def call(self, text: str, session_id: str) -> dict[str, Any] | None:
        """The reply's tool call from the generated text, or None when it is not a whole call
        (a generation cut by ``max_tokens``: the text is then the reply's content). A named
        function's arguments are the text itself, as its stream gave them."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.choice is not None:
            return self.call_start(session_id, arguments=text)
        if not (isinstance(value, dict) and value.get("name") in dict(self.functions)):
            return None
        arguments = json.dumps(value.get("arguments", {}), separators=(",", ":"))
        return {**self.call_start(session_id, arguments), "function": {"name": value["name"], "arguments": arguments}}

    def call_start(self, session_id: str, arguments: str = "") -> dict[str, Any]:
        """The call's id, type and name (a named function's, known before any token): a stream's
        first tool-call chunk, the arguments following in the next ones."""
        return {"id": f"call_{session_id.replace('-', '')[:24]}", "type": "function",
                "function": {"name": self.choice, "arguments": arguments}}


def parse_tools(body: dict) -> ToolCalling | None:
    """The request's tool calling, or None when no tool is to be called (no tools, or "none")."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_param("parallel_tool_calls", "'parallel_tool_calls' must be a boolean.", code="invalid_type")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_param("tool_choice", "'tool_choice' is only allowed when 'tools' are specified.")
        return None
    if not isinstance(tools, list):
        raise bad_param("tools", "'tools' must be a list of functions.", code="invalid_type")
    functions = tuple(_function(index, tool) for index, tool in enumerate(tools))
    names = [name for name, _ in functions]
    if len(set(names)) != len(names):
        raise bad_param("tools", "function names must be unique.")
    if choice is None or choice == "auto":
        raise unsupported("tool_choice", "'none', 'required' or a named function (not 'auto', the default "
                                         "when tools are given)")
    if choice == "none":
        return None
    if choice == "required":
        return ToolCalling(functions, None)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) \
        and choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if named is None:
        raise bad_param("tool_choice", "'tool_choice' must be 'none', 'required', or "
                        "{'type': 'function', 'function': {'name': ...}}.")
    if named not in names:
        raise bad_param("tool_choice.function.name", f"no function named {named!r} in 'tools'.")
    return ToolCalling(functions, named)


def _function(index: int, tool: Any) -> tuple[str, str]:
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
    parameters = function.get("parameters", NO_PARAMETERS)
    try:
        constraint_from_response_format({"type": "json_schema", "json_schema": {"name": name, "schema": parameters}},
                                        field=f"{where}.function")
    except ConstraintError as error:
        param, message = str(error).split(": ", 1)
        raise bad_param(param.replace(".json_schema.schema", ".parameters"), f"Invalid function parameters: {message}")
    return name, json.dumps(parameters)
