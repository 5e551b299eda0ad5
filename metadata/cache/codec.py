"""Cached values as typed, versioned JSON: what the shared tier writes to and reads from Redis.

Whoever can write to Redis must not be able to run code in the web and the workers, so nothing
read from Redis is unpickled. A payload is JSON ``{"format": 1, "lsn": <int>, "value": ...}``;
JSON's own types pass as they are, and the few other types cached rows carry are tagged
objects with one explicit encoder and decoder each (``{"$t": "datetime", "v": "..."}``). A
payload that is not this (an unknown format, another program's bytes, a planted pickle) is
unreadable: the tier treats it as a miss and loads the value again, never as an error.

Hand-written rather than a library: the standard library's and Django's JSON encoders write
datetimes and UUIDs as plain strings that do not come back as what they were, and msgspec (not
a dependency) would need a schema per cached shape for the same few tags.
"""
from __future__ import annotations

import base64
import datetime as dt
import json
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

FORMAT = 1  # bumped when a payload's layout changes: older payloads are then misses
TAG = "$t"


class UnreadableEntry(ValueError):
    """A payload this codec did not write (or a format it does not know): a miss, not an error."""


class UncacheableValue(TypeError):
    """A value with a type no encoder knows: it is served, not cached."""


# type -> (tag, encoder); tag -> decoder. Exact types: a datetime is not cached as the date it
# subclasses; a str or int subclass (a choices member) is cached as its plain value.
_ENCODERS: dict[type, tuple[str, Callable[[Any], Any]]] = {
    dt.datetime: ("datetime", lambda value: value.isoformat()),
    dt.date: ("date", lambda value: value.isoformat()),
    dt.time: ("time", lambda value: value.isoformat()),
    dt.timedelta: ("timedelta", lambda value: [value.days, value.seconds, value.microseconds]),
    uuid.UUID: ("uuid", lambda value: value.hex),
    Decimal: ("decimal", str),
    bytes: ("bytes", lambda value: base64.b64encode(value).decode("ascii")),
}
_DECODERS: dict[str, Callable[[Any], Any]] = {
    "datetime": dt.datetime.fromisoformat,
    "date": dt.date.fromisoformat,
    "time": dt.time.fromisoformat,
    "timedelta": lambda parts: dt.timedelta(days=parts[0], seconds=parts[1], microseconds=parts[2]),
    "uuid": uuid.UUID,
    "decimal": Decimal,
    "bytes": lambda text: base64.b64decode(text, validate=True),
    "tuple": lambda items: tuple(_decode(item) for item in items),
    "dict": lambda pairs: {_decode(key): _decode(value) for key, value in pairs},
}
_PLAIN = (str, int, float, bool, type(None))


def _encode(value: Any) -> Any:
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is list:
        return [_encode(item) for item in value]
    if kind is tuple:
        return {TAG: "tuple", "v": [_encode(item) for item in value]}
    if kind is dict:
        if all(type(key) is str for key in value) and TAG not in value:
            return {key: _encode(item) for key, item in value.items()}
        return {TAG: "dict", "v": [[_encode(key), _encode(item)] for key, item in value.items()]}
    encoder = _ENCODERS.get(kind)
    if encoder is None:
        if isinstance(value, str):  # a choices member (``SessionStatus.QUEUED``): cached as its text
            return str.__str__(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        raise UncacheableValue(f"a {kind.__module__}.{kind.__qualname__} has no cache encoder")
    tag, encode = encoder
    return {TAG: tag, "v": encode(value)}


def _decode(value: Any) -> Any:
    if type(value) is list:
        return [_decode(item) for item in value]
    if type(value) is dict:
        if TAG in value:
            return _DECODERS[value[TAG]](value["v"])
        return {key: _decode(item) for key, item in value.items()}
    return value


def dumps(value: Any, source_lsn: int) -> bytes:
    """The payload of ``value`` known to reflect ``source_lsn``; raises ``UncacheableValue``."""
    return json.dumps({"format": FORMAT, "lsn": source_lsn, "value": _encode(value)},
                      separators=(",", ":"), allow_nan=True).encode()


def loads(payload: bytes) -> tuple[Any, int]:
    """``(value, source_lsn)`` of a payload ``dumps`` wrote; raises ``UnreadableEntry`` for anything else."""
    try:
        document = json.loads(payload)
        if type(document) is not dict or document.get("format") != FORMAT or type(document.get("lsn")) is not int:
            raise UnreadableEntry(f"not a format-{FORMAT} cache entry")
        return _decode(document["value"]), document["lsn"]
    except UnreadableEntry:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as exc:
        raise UnreadableEntry(f"unreadable cache entry: {exc!r}") from None
