"""Request parsers: a body is refused (400) when Python cannot parse it or the database cannot hold it.

``json.loads`` raises ``RecursionError`` (not ``ValueError``) for input nested a few thousand
levels deep, so DRF's parser lets it through as a 500. JSON may also carry text no query can
take: ``"\\u0000"`` (PostgreSQL text cannot hold NUL) and lone surrogates (``"\\ud800"``, which
no UTF-8 encoder accepts, not even the one that renders the error naming them). Both are refused
here, at the parser, for every string of the body (keys included), with the field's path and the
rule, before a serializer, a query or a renderer sees them. ``loads_json`` is the same rule for
the plain (non-DRF) views; ``text_rule_broken`` is the check, for query strings and paths too.
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
