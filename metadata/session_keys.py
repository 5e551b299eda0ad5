"""How a session's id and its partition key (``created_at``) go together, for ``metadata.models``.

A new session's id is the UUIDv7 of its ``created_at`` (``matching_id_and_time``), so a filter by id
can add the ``created_at`` the id carries (``partition_key_filter``) and PostgreSQL reads one
partition; ``SessionQuerySet`` applies it to every ``filter()``.
"""
from __future__ import annotations

import datetime as dt
from typing import Any

from django.db import models
from django.utils import timezone

from metadata.ids import created_at_of, is_uuid7, to_millisecond, uuid7


def partition_key_filter(lookups: dict[str, Any]) -> dict[str, Any]:
    """``lookups`` plus the ``created_at`` the session id(s) in them carry, when every id is a UUIDv7.

    ``pk=<v7>`` adds ``created_at=<its time>``; ``pk__in=[v7, ...]`` adds ``created_at__in``
    (exact: a UUIDv7 session's created_at is its id's time). Ids made before UUIDv7 add nothing:
    their lookup reads one index per partition.
    """
    if any(key == "created_at" or key.startswith("created_at__") for key in lookups):
        return lookups
    for key in ("pk", "id"):
        if key in lookups:
            when = created_at_of(lookups[key]) if lookups[key] is not None else None
            return {**lookups, "created_at": when} if when is not None else lookups
    for key in ("pk__in", "id__in"):
        values = lookups.get(key)
        if isinstance(values, (list, tuple, set, frozenset)) and values:
            times = [created_at_of(value) for value in values]
            if all(when is not None for when in times):
                return {**lookups, "created_at__in": sorted(set(times))}
            return lookups
    return lookups


class SessionQuerySet(models.QuerySet):
    """Filters by session id carry the partition key the id holds (see ``partition_key_filter``).

    ``get()``, ``Model.save()``'s UPDATE, ``refresh_from_db()`` and ``bulk_update()`` all filter
    through here (``Meta.base_manager_name``), so they prune to one partition too.
    """

    def filter(self, *args: Any, **kwargs: Any) -> SessionQuerySet:
        return super().filter(*args, **partition_key_filter(kwargs))


def matching_id_and_time(fields: dict[str, Any]) -> dict[str, Any]:
    """A new session's id and ``created_at`` made to agree (``Session``'s docstring)."""
    given = fields.get("id", fields.get("pk"))
    when = fields.get("created_at")
    if when is not None and not isinstance(when, dt.datetime):
        return fields  # not a time: left for the field's own validation to refuse
    if given is None:
        created = to_millisecond(when or timezone.now())
        fields = {k: v for k, v in fields.items() if k != "pk"}
        return {**fields, "id": uuid7(created), "created_at": created}
    if not is_uuid7(given):
        return fields
    carried = created_at_of(given)
    if when is None:
        return {**fields, "created_at": carried}
    if to_millisecond(when) != carried:
        raise ValueError(f"session {given} is a UUIDv7 of {carried.isoformat()}; created_at "
                         f"{when.isoformat()} differs (an id carries its creation time)")
    return {**fields, "created_at": carried}
