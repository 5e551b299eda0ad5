"""Keyset pagination with opaque cursors, correct for mixed ASC/DESC orderings.

DRF's CursorPagination keys on the first ordering field only, and the row comparison
``(score, id) > (s, i)`` is wrong when directions are mixed (it returns earlier pages). For an
ordering ``c1 d1, c2 d2, ..., cn dn`` the predicate after the row ``(s1, ..., sn)`` is built as

    c1 ≤/≥ s1 AND (c1 </> s1 OR (c2 ≤/≥ s2 AND (c2 </> s2 OR ... cn </> sn)))

which is exactly "strictly after in this order", and whose leading conjunct gives the index a
range on ``c1`` (the plain ``c1 < s1 OR (c1 = s1 AND ...)`` hides it; see DESIGN.md). Keys must be
NOT NULL and the full ordering must be unique within the filtered set.
"""
from __future__ import annotations

import base64
import datetime
import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import models
from django.db.models import Model, Q, QuerySet
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.utils.urls import replace_query_param

from core.parsers import text_rule_broken

CURSOR_PARAM = "cursor"
NOT_A_CURSOR = "is not a cursor this API issued (use the previous page's `next`)."
MAX_CURSOR_LENGTH = 1000
PAGE_SIZE_PARAM = "page_size"


@dataclass(frozen=True)
class KeyColumn:
    field: str
    descending: bool = False

    @property
    def order_by(self) -> str:
        return f"-{self.field}" if self.descending else self.field


def after_predicate(columns: tuple[KeyColumn, ...], values: list[Any]) -> Q:
    """Return the Q that selects rows strictly after ``values`` in the order of ``columns``."""
    last = columns[-1]
    predicate = Q(**{f"{last.field}__{'lt' if last.descending else 'gt'}": values[-1]})
    for column, value in zip(reversed(columns[:-1]), reversed(values[:-1])):
        strict = Q(**{f"{column.field}__{'lt' if column.descending else 'gt'}": value})
        bound = Q(**{f"{column.field}__{'lte' if column.descending else 'gte'}": value})
        predicate = bound & (strict | predicate)
    return predicate


def _encode_value(value: Any) -> Any:
    if isinstance(value, datetime.datetime):
        return {"dt": value.isoformat()}
    if isinstance(value, uuid.UUID):
        return {"uuid": str(value)}
    return value


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict) and "dt" in value:
        return datetime.datetime.fromisoformat(value["dt"])
    if isinstance(value, dict) and "uuid" in value:
        return uuid.UUID(value["uuid"])
    return value


def encode_cursor(values: list[Any]) -> str:
    raw = json.dumps([_encode_value(v) for v in values], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, width: int) -> list[Any]:
    """The values of a cursor this API issued; anything else is a 400 naming ``cursor``."""
    try:
        if len(cursor) > MAX_CURSOR_LENGTH:
            raise ValueError("too long")
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        values = json.loads(raw)
        if not isinstance(values, list) or len(values) != width:
            raise ValueError(f"not a list of {width} values")
        return [_decode_value(v) for v in values]
    except (ValueError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        # binascii.Error and UnicodeDecodeError are ValueErrors; a forged {"uuid": 5} is a TypeError
        raise ValidationError({CURSOR_PARAM: [NOT_A_CURSOR]}) from exc


def key_value(model: type[Model], column: KeyColumn, value: Any) -> Any:
    """``value`` as the column's field holds it; a value the column cannot hold is a 400 on ``cursor``."""
    field = model._meta.pk if column.field == "pk" else model._meta.get_field(column.field)
    try:
        if value is None:
            raise ValueError("keys are NOT NULL")
        if isinstance(value, str) and text_rule_broken(value):
            raise ValueError("no query can take this text")
        typed = field.to_python(value)
        if isinstance(field, models.IntegerField) and not -2**63 <= typed < 2**63:
            raise ValueError("out of range")
        if isinstance(field, models.FloatField) and math.isnan(typed):  # -inf is a real draft score
            raise ValueError("not a number")
    except (DjangoValidationError, ValueError, TypeError, OverflowError) as exc:
        raise ValidationError({CURSOR_PARAM: [NOT_A_CURSOR]}) from exc
    return typed


class KeysetPagination:
    """A DRF pagination class: ``?cursor=`` (opaque) and ``?page_size=`` (1..max)."""

    columns: tuple[KeyColumn, ...] = (KeyColumn("pk"),)
    page_size = 50
    max_page_size = 500

    def __init__(self, columns: tuple[KeyColumn, ...] | None = None, page_size: int | None = None) -> None:
        if columns is not None:
            self.columns = columns
        if page_size is not None:
            self.page_size = page_size

    def page(self, queryset: QuerySet, cursor: str | None, size: int) -> tuple[list, str | None]:
        """Return (rows, next cursor or None) for the page after ``cursor``."""
        ordered = queryset.order_by(*(c.order_by for c in self.columns))
        if cursor:
            values = decode_cursor(cursor, len(self.columns))
            typed = [key_value(queryset.model, c, v) for c, v in zip(self.columns, values)]
            ordered = ordered.filter(after_predicate(self.columns, typed))
        rows = list(ordered[: size + 1])
        if len(rows) <= size:
            return rows, None
        rows = rows[:size]
        return rows, encode_cursor([getattr(rows[-1], c.field) for c in self.columns])

    def paginate_queryset(self, queryset: QuerySet, request, view=None) -> list:
        self.request = request
        size = self._page_size(request)
        rows, self.next_cursor = self.page(queryset, request.query_params.get(CURSOR_PARAM), size)
        return rows

    def _page_size(self, request) -> int:
        raw = request.query_params.get(PAGE_SIZE_PARAM)
        if raw is None:
            return self.page_size
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= self.max_page_size:  # "²".isdigit()
            raise ValidationError({PAGE_SIZE_PARAM: [f"must be an integer from 1 to {self.max_page_size}."]})
        return int(raw)

    def get_paginated_response(self, data) -> Response:
        next_url = None
        if self.next_cursor:
            next_url = replace_query_param(self.request.build_absolute_uri(), CURSOR_PARAM, self.next_cursor)
        return Response({"next": next_url, "results": data})

    def get_paginated_response_schema(self, schema: dict) -> dict:
        return {"type": "object", "required": ["results"], "properties": {
            "next": {"type": "string", "format": "uri", "nullable": True}, "results": schema}}

    def get_schema_operation_parameters(self, view) -> list[dict]:
        return [
            {"name": CURSOR_PARAM, "in": "query", "required": False, "schema": {"type": "string"},
             "description": "Opaque cursor from the previous page's `next`."},
            {"name": PAGE_SIZE_PARAM, "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": self.max_page_size}},
        ]


class SessionPagination(KeysetPagination):
    columns = (KeyColumn("created_at", descending=True), KeyColumn("id"))


class TokenPagination(KeysetPagination):
    columns = (KeyColumn("position"),)
    page_size = 200


class CandidatePagination(KeysetPagination):
    columns = (KeyColumn("score", descending=True), KeyColumn("step"), KeyColumn("branch"))
