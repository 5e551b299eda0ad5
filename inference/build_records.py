"""Where long model builds stand: one JSON record per build in a Redis hash, for readers.

A build (`demo:quick-0`, `demo:seed0`) runs in its own process and writes its record here (the
demo's `inference.demo.progress.BuildProgress`: phase, step, total, ETA, state). The web process
reads it back: `inference.registry.pending_build` (a request for a model still being built is a
503) and the admin's build progress. Here, apart from the demo build, so that the registry reads
records without importing the builder.

A record is a convenience for readers; a build resumes from its own checkpoints, not from it.
Redis being down loses the record, never the build.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

import redis
from django.conf import settings

logger = logging.getLogger(__name__)

KEY = "specops:demo_builds"
BUILDING, DONE, FAILED, INTERRUPTED, STALLED = "building", "done", "failed", "interrupted", "stalled"
#: A build whose record has not moved for this long is shown as stalled (a step of the full
#: build takes seconds; its slowest un-counted phase, tokenizing the corpus, about a minute).
STALE_AFTER_S = 600.0


def redis_client() -> redis.Redis:
    """A client of the records' Redis, with short timeouts (a reader must not hang on it)."""
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


def record_field(name: str, version: str) -> str:
    """The hash field of one build's record: `demo:seed0`."""
    return f"{name}:{version}"


def write_build_record(record: dict[str, Any], client: redis.Redis | None = None) -> None:
    """Store a build's record (its `name` and `version` name the field); raises RedisError."""
    (client or redis_client()).hset(KEY, record_field(record["name"], record["version"]), json.dumps(record))


def _alive(record: dict[str, Any]) -> bool:
    if record.get("host") != socket.gethostname():
        return True  # another host's process: only the age of the record tells
    try:
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, TypeError, ValueError):
        return True
    return True


def _as_read(record: dict[str, Any], now: float) -> dict[str, Any]:
    """The record with its state as a reader should see it: a dead build's is not 'building'."""
    record = dict(record)
    record["age_s"] = round(now - record.get("updated_at", now), 1)
    if record["state"] == BUILDING:
        if not _alive(record):
            record.update(state=INTERRUPTED, message="the build process is gone; `make run` resumes it",
                          eta_s=None)
        elif record["age_s"] > STALE_AFTER_S:
            record["state"] = STALLED
    return record


def build_records(name: str | None = None, client: redis.Redis | None = None) -> list[dict[str, Any]]:
    """Every recorded build (of `name`), most recently updated first; [] when Redis is down."""
    try:
        raw = (client or redis_client()).hgetall(KEY)
    except redis.RedisError as exc:
        logger.warning("could not read demo build progress from Redis: %s", exc)
        return []
    now = time.time()
    records = []
    for value in raw.values():
        try:
            record = json.loads(value)
        except ValueError:
            continue
        if name is None or record.get("name") == name:
            records.append(_as_read(record, now))
    return sorted(records, key=lambda r: r.get("updated_at", 0), reverse=True)


def build_record(name: str, version: str, client: redis.Redis | None = None) -> dict[str, Any] | None:
    """The record of one build, as a reader should see it, or None."""
    try:
        value = (client or redis_client()).hget(KEY, record_field(name, version))
    except redis.RedisError as exc:
        logger.warning("could not read demo build progress from Redis: %s", exc)
        return None
    if value is None:
        return None
    try:
        return _as_read(json.loads(value), time.time())
    except ValueError:
        return None
