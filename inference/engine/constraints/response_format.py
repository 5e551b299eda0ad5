"""The OpenAI `response_format` object as an OutputConstraint: one reading for both APIs and the worker.

Both APIs take the same object (`{"type": "text"}`, `{"type": "json_object"}`,
`{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`); a
session stores it as given, and the worker reads it back here. A refusal is a ConstraintError
whose message starts with the path of the field at fault (`response_format.json_schema.schema`).

SpecOps adds one type of its own, `{"type": "grammar", "grammar": {"syntax": "lark", "definition":
...}}` (the shape of OpenAI's grammar-constrained custom tools): an llguidance Lark grammar. The
OpenAI API's tool calls travel to the worker as one (inference/api/openai/tools.py).
"""

from __future__ import annotations

from typing import Any

from inference.engine.constraints.grammar import check_constraint
from inference.engine.constraints.spec import GRAMMAR, JSON_OBJECT, JSON_SCHEMA, ConstraintError, OutputConstraint

TEXT = "text"
TYPES = (TEXT, JSON_OBJECT, JSON_SCHEMA, GRAMMAR)
JSON_SCHEMA_FIELDS = ("name", "schema", "strict", "description")
GRAMMAR_FIELDS = ("syntax", "definition")
LARK = "lark"


def _refuse(path: str, rule: str) -> ConstraintError:
    return ConstraintError(f"{path}: {rule}")


def constraint_from_response_format(value: Any, field: str = "response_format", *, compile: bool = True,
                                    remember: bool = True) -> OutputConstraint | None:
    """The constraint `value` asks for (None: free text); raise ConstraintError naming the field.

    The schema is compiled (without a tokenizer) before this returns, so a schema the grammar
    engine cannot handle is refused here, before anything is enqueued; `compile=False` checks
    its shape only, `remember=False` compiles without remembering (`grammar.check_constraint`).
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _refuse(field, "must be an object with a 'type'")
    kind = value.get("type")
    if kind not in TYPES:
        raise _refuse(f"{field}.type", f"must be one of {', '.join(TYPES)}")
    allowed = {"type"} | ({kind} if kind in (JSON_SCHEMA, GRAMMAR) else set())
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise _refuse(f"{field}.{unknown[0]}", f"unknown field for type {kind!r}")
    if kind == TEXT:
        return None
    if kind == JSON_OBJECT:
        return OutputConstraint(JSON_OBJECT)
    if kind == GRAMMAR:
        constraint, path = _grammar(value.get(GRAMMAR), f"{field}.{GRAMMAR}"), f"{field}.{GRAMMAR}.definition"
    else:
        constraint, path = _json_schema(value.get(JSON_SCHEMA), f"{field}.{JSON_SCHEMA}"), f"{field}.{JSON_SCHEMA}.schema"
    if compile:
        try:
            check_constraint(constraint, remember=remember)
        except ConstraintError as error:
            raise _refuse(path, str(error).removeprefix("constraint.schema: ")) from None
    return constraint


def _json_schema(spec: Any, path: str) -> OutputConstraint:
    if not isinstance(spec, dict):
        raise _refuse(path, "must be an object with 'name' and 'schema'")
    unknown = sorted(set(spec) - set(JSON_SCHEMA_FIELDS))
    if unknown:
        raise _refuse(f"{path}.{unknown[0]}", f"unknown field; takes {', '.join(JSON_SCHEMA_FIELDS)}")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise _refuse(f"{path}.name", "must be a non-empty string")
    if spec.get("strict") not in (None, True, False):
        raise _refuse(f"{path}.strict", "must be a boolean")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _refuse(f"{path}.schema", "must be a JSON schema object")
    return OutputConstraint.json_schema(schema)


def _grammar(spec: Any, path: str) -> OutputConstraint:
    if not isinstance(spec, dict):
        raise _refuse(path, "must be an object with 'syntax' and 'definition'")
    unknown = sorted(set(spec) - set(GRAMMAR_FIELDS))
    if unknown:
        raise _refuse(f"{path}.{unknown[0]}", f"unknown field; takes {', '.join(GRAMMAR_FIELDS)}")
    if spec.get("syntax", LARK) != LARK:
        raise _refuse(f"{path}.syntax", f"must be {LARK!r}")
    definition = spec.get("definition")
    if not isinstance(definition, str) or not definition.strip():
        raise _refuse(f"{path}.definition", "must be a non-empty string (an llguidance Lark grammar)")
    return OutputConstraint.lark(definition)
