"""Model rows as cacheable values: a row's field values out, a fresh instance back in.

A cached model instance shared by every reader of the local tier would carry whatever one
reader set on it to the next (``request.user`` gets attributes; related caches fill in), so the
caches of credentials and model versions store the field values and rebuild an instance per
read, as a query would have: ``Model.from_db``, no query.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import DEFAULT_DB_ALIAS
from django.db.models import Model


def row_of(instance: Model, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The instance's concrete field values, by attribute name (``tenant_id``, not ``tenant``),
    less the fields in ``exclude`` (what must not leave the process: a token's key, a password hash)."""
    left_out = frozenset(exclude)
    return {field.attname: getattr(instance, field.attname) for field in instance._meta.concrete_fields
            if field.attname not in left_out}


def instance_of(model: type[Model], row: dict[str, Any]) -> Model:
    """An instance of ``model`` as a query would have built it from ``row`` (no query); a field
    the row lacks is deferred, as ``.only()`` leaves it (read from the database if used)."""
    return model.from_db(DEFAULT_DB_ALIAS, list(row), list(row.values()))
