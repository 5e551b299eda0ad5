"""What a request constrains its output to, as plain data that pickles and hashes.

A constraint travels from the API to the engine core (another process) inside a
GenerationConfig, so it is a kind and a schema string, never a compiled grammar: the engine
compiles it there, once per (tokenizer, constraint) (`grammar.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from inference.engine.errors import ConfigError

JSON_OBJECT = "json_object"
JSON_SCHEMA = "json_schema"
GRAMMAR = "grammar"
KINDS = (JSON_OBJECT, JSON_SCHEMA, GRAMMAR)


class ConstraintError(ConfigError):
    """A constraint the grammar engine cannot compile; the message names the field and why."""


@dataclass(frozen=True)
class OutputConstraint:
    """The output must be a JSON object (`json_object`), match a JSON schema (`json_schema`), or
    follow a grammar (`grammar`: llguidance's Lark syntax, which may inline JSON schemas with
    `%json {...}`; the API's tool calls are one, inference/api/openai/tools.py).

    `schema` is the schema as a JSON string (a dict would not hash), or the grammar's text; it is
    required for `json_schema` and `grammar`, refused for `json_object`. Only the structure is
    checked here; whether the grammar engine can compile it is `grammar.check_constraint`'s question.
    """

    kind: str
    schema: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint.kind: must be one of {', '.join(KINDS)}")
        if self.kind == JSON_OBJECT:
            if self.schema is not None:
                raise ConstraintError("constraint.schema: must be empty for json_object")
            return
        if self.kind == GRAMMAR:
            if not isinstance(self.schema, str) or not self.schema.strip():
                raise ConstraintError("constraint.schema: a grammar constraint needs the grammar's text")
            return
        if not isinstance(self.schema, str):
            raise ConstraintError("constraint.schema: a json_schema constraint needs the schema as a JSON string")
        try:
            parsed = json.loads(self.schema)
        except ValueError as error:
            raise ConstraintError(f"constraint.schema: not valid JSON ({error})") from None
        if not isinstance(parsed, dict):
            raise ConstraintError("constraint.schema: must be a JSON object")

    @classmethod
    def json_schema(cls, schema: dict) -> OutputConstraint:
        """A `json_schema` constraint from a schema dict (keys keep their order: properties are
        generated in the order the schema lists them)."""
        return cls(JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @classmethod
    def lark(cls, grammar: str) -> OutputConstraint:
        """A `grammar` constraint from llguidance Lark text."""
        return cls(GRAMMAR, grammar)

    @property
    def schema_source(self) -> str:
        """The JSON schema the grammar is built from: `json_object` is any object."""
        return self.schema if self.schema is not None else '{"type":"object"}'
