"""Request parsers: JSON whose nesting Python cannot parse is a 400 that names the body.

``json.loads`` raises ``RecursionError`` (not ``ValueError``) for input nested a few thousand
levels deep, so DRF's parser lets it through as a 500. ``loads_json`` is the same rule for the
plain (non-DRF) views.
"""
from __future__ import annotations

import json
from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError

TOO_DEEP = "request body: JSON nested too deeply to parse."


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, with deep nesting reported as a parse error (400)."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError(TOO_DEEP) from None


class BodyNotJSON(ValueError):
    """The body is not JSON (or nests too deeply); ``str()`` is the client's message."""


def loads_json(body: bytes) -> Any:
    """Parse a request body for a plain view; raise ``BodyNotJSON`` with a message naming the body."""
    try:
        return json.loads(body)
    except RecursionError:
        raise BodyNotJSON(TOO_DEEP) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyNotJSON(f"request body: not valid JSON ({exc}).") from None
