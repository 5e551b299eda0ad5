"""Request parsers: a body is refused (400) when Python cannot parse it or the database cannot hold it.

``json.loads`` raises ``RecursionError`` (not ``ValueError``) for input nested a few thousand
levels deep, so DRF's parser lets it through as a 500. JSON may also carry text no query can
take: ``"\\u0000"`` (PostgreSQL text cannot hold NUL) and lone surrogates (``"\\ud800"``, which
no UTF-8 encoder accepts, not even the one that renders the error naming them). Both are refused
here, at the parser, for every string of the body (keys included), with the field's path and the
rule, before a serializer, a query or a renderer sees them. ``loads_json`` is the same rule for
the plain (non-DRF) views; ``text_rule_broken`` is the check, for query strings and paths too.

The API parses JSON and forms (urlencoded or multipart), nothing else (any other content type is
DRF's 415). A form's fields are held to the same text rules (``FormParser``, ``MultiPartParser``,
which refuses files: no endpoint takes one); a form field that carries JSON (``response_format``)
is parsed by ``loads_json_field``, with the same depth and text rules as a JSON body.
"""
from __future__ import annotations

import json
import re
from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError, ValidationError

TOO_DEEP = "request body: JSON nested too deeply to parse."
NUL_RULE = "must not contain NUL characters"
SURROGATE_RULE = "must be valid UTF-8 (no lone surrogates)"
_SURROGATE = re.compile("[\ud800-\udfff]")


def text_rule_broken(text: str) -> str | None:
    """The rule ``text`` breaks (NUL_RULE or SURROGATE_RULE), or None when a query can take it."""
    if "\x00" in text:
        return NUL_RULE
    if _SURROGATE.search(text):
        return SURROGATE_RULE
    return None


def unsafe_text(value: Any, path: str = "") -> tuple[str, str] | None:
    """``(path, rule)`` of the first string in ``value`` that breaks a text rule, else None.

    ``path`` names the field as a client wrote it: ``stop[1]``, ``messages[0].content``; a key that
    breaks a rule is named by where it is (``metadata (a key)``, or ``(a field name)`` at the top).
    """
    if isinstance(value, str):
        rule = text_rule_broken(value)
        return (path, rule) if rule else None
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = unsafe_text(item, f"{path}[{index}]")
            if found:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            if text_rule_broken(str(key)):
                return f"{path} (a key)" if path else "(a field name)", text_rule_broken(str(key))
            found = unsafe_text(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    return None


def nesting_depth(value: Any) -> int:
    """How deeply lists and objects nest in ``value`` (0 for a scalar), counted without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children)
    return deepest


def top_field(path: str) -> str:
    """The request field a path is in: ``messages`` for ``messages[0].content``."""
    if path.startswith("("):  # a field name that breaks a rule is no field to name
        return "non_field_errors"
    return re.split(r"[.\[ ]", path, maxsplit=1)[0] or "non_field_errors"


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser; deep nesting is a parse error, a text rule a field error (both 400)."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError(TOO_DEEP) from None
        found = unsafe_text(data)
        if found:
            path, rule = found
            raise ValidationError({top_field(path): [f"{path}: {rule}."]})
        return data


def check_form_fields(data) -> None:
    """Raise a field error (400) for the first form field whose name or value breaks a text rule."""
    for name, values in data.lists():
        rule = text_rule_broken(name)
        if rule:
            raise ValidationError({"non_field_errors": [f"a field name {rule}."]})
        for value in values:
            rule = text_rule_broken(value)
            if rule:
                raise ValidationError({name: [f"{name}: {rule}."]})


class FormParser(parsers.FormParser):
    """DRF's form parser, held to the text rules (``check_form_fields``)."""

    def parse(self, stream, media_type=None, parser_context=None):
        data = super().parse(stream, media_type, parser_context)
        check_form_fields(data)
        return data


class MultiPartParser(parsers.MultiPartParser):
    """DRF's multipart parser for form fields only, held to the text rules; a file is a 400 (no
    endpoint takes one). The body is within the body limit before this runs (``core.body_limit``),
    so Django's upload handlers keep it in memory (``FILE_UPLOAD_MAX_MEMORY_SIZE``)."""

    def parse(self, stream, media_type=None, parser_context=None):
        parsed = super().parse(stream, media_type, parser_context)
        for name in parsed.files:
            raise ValidationError({name: [f"{name}: a file; this API takes no uploads (send the field as text)."]})
        check_form_fields(parsed.data)
        return parsed


def loads_json_field(text: str | bytes, field: str) -> Any:
    """A form field's JSON text, parsed with a JSON body's rules; ``BodyNotJSON`` (its ``param``
    the field) names the field and the rule."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise BodyNotJSON(f"{field}: JSON nested too deeply to parse.", param=field) from None
    except (ValueError, UnicodeDecodeError):
        raise BodyNotJSON(f"{field}: not valid JSON.", param=field) from None
    found = unsafe_text(data, field)
    if found:
        path, rule = found
        raise BodyNotJSON(f"{path}: {rule}.", param=field)
    return data


class BodyNotJSON(ValueError):
    """The body is not JSON (or nests too deeply); ``str()`` is the client's message, ``param``
    the field at fault when one is (a text rule), else None."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def loads_json(body: bytes) -> Any:
    """Parse a request body for a plain view; raise ``BodyNotJSON`` with a message naming the body
    or the field that breaks a text rule."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise BodyNotJSON(TOO_DEEP) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyNotJSON(f"request body: not valid JSON ({exc}).") from None
    found = unsafe_text(data)
    if found:
        path, rule = found
        raise BodyNotJSON(f"'{path}' {rule}.", param=None if path.startswith("(") else path)
    return data
