"""Session ids that carry their partition: UUIDv7 (RFC 9562, section 5.7).

The first 48 bits of a UUIDv7 are its Unix time in milliseconds, so a session's id says which
``created_at`` partition holds it: a lookup by id adds ``created_at = created_at_of(id)`` and
PostgreSQL prunes to one partition. A session's ``created_at`` is the id's millisecond, exactly
(``metadata.models.Session`` makes the two together).

Hand-written in a few lines because the standard library has ``uuid.uuid7`` only from Python
3.14, and the packages that backport it (``uuid6``, ``uuid-utils``) make ids for *now* only,
while sessions are also made at a given time (a migration, the benchmarks, tests of old
partitions). Ids made before UUIDv7 (version 4) carry no time: ``created_at_of`` returns None
and their lookups scan every partition's index (bounded by the number of partitions).
"""
from __future__ import annotations

import datetime as dt
import os
import uuid

_VERSION = 7
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def uuid7(at: dt.datetime | None = None) -> uuid.UUID:
    """A UUIDv7 for the millisecond ``at`` (now when None): 48 bits of time, 74 random bits."""
    millis = _millis(at) if at is not None else _millis(dt.datetime.now(dt.timezone.utc))
    if not 0 <= millis < 1 << 48:
        raise ValueError(f"{at!r} is outside the UUIDv7 time range")
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits, 74 of them used
    rand_a = rand >> 68  # 12 bits
    rand_b = rand & ((1 << 62) - 1)  # 62 bits
    value = (millis << 80) | (_VERSION << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
    return uuid.UUID(int=value)


def is_uuid7(value: uuid.UUID | str) -> bool:
    parsed = _parse(value)
    return parsed is not None and parsed.version == _VERSION and parsed.variant == uuid.RFC_4122


def created_at_of(value: uuid.UUID | str) -> dt.datetime | None:
    """The creation time a UUIDv7 carries (UTC, to the millisecond); None for any other id.

    Also None for a time past ``datetime.max`` (a well-formed UUIDv7 can carry up to year 10889):
    no session was ever made then, so such an id is simply not found.
    """
    parsed = _parse(value)
    if parsed is None or parsed.version != _VERSION or parsed.variant != uuid.RFC_4122:
        return None
    try:
        return _EPOCH + dt.timedelta(milliseconds=parsed.int >> 80)
    except OverflowError:
        return None


def to_millisecond(moment: dt.datetime) -> dt.datetime:
    """``moment`` truncated to its millisecond (what a UUIDv7 can carry), in UTC."""
    return _EPOCH + dt.timedelta(milliseconds=_millis(moment))


def _millis(moment: dt.datetime) -> int:
    if moment.tzinfo is None:
        raise ValueError("a session's creation time must be timezone-aware")
    delta = moment - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def _parse(value: uuid.UUID | str) -> uuid.UUID | None:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except (ValueError, TypeError, AttributeError):
        return None
