"""Each device's prefix-cache figures in Redis, for the operators' dashboard.

Prometheus has them per process (metrics.py); the admin dashboard, which reads no Prometheus,
shows each device's cache memory and hit figures from a short-lived Redis hash the device's
front refreshes while it steps (at most every `PUBLISH_EVERY_S`; the key expires `TTL_S` after
the last refresh, so a device that stopped drops off the table).
"""
from __future__ import annotations

import json
import logging
import socket
import time

from django_redis import get_redis_connection

from inference.conf import conf

logger = logging.getLogger(__name__)

KEY_PREFIX = "specops:prefix-cache:"
PUBLISH_EVERY_S = 5.0
TTL_S = 60

_last_publish = 0.0


def device_name() -> str:
    """This worker's device as the dashboard names it: ``<device>@<host>``."""
    return f"{conf.WORKER_DEVICE}@{socket.gethostname()}"


def publish(stats) -> None:
    """Refresh this device's reading from a `PrefixCacheStats` (throttled; Redis errors are logged, not raised)."""
    global _last_publish
    now = time.monotonic()
    if now - _last_publish < PUBLISH_EVERY_S:
        return
    _last_publish = now
    reading = {"bytes": stats.bytes, "blocks": stats.blocks, "lookups": stats.lookups, "hits": stats.hits,
               "hit_tokens": stats.hit_tokens, "lookup_tokens": stats.lookup_tokens,
               "evicted_blocks": stats.evicted_blocks, "limit_bytes": conf.PREFIX_CACHE_MB * 1024 * 1024}
    try:
        get_redis_connection("default").set(KEY_PREFIX + device_name(), json.dumps(reading), ex=TTL_S)
    except Exception:  # the dashboard's reading is not worth failing a step for
        logger.warning("prefix cache reading not published", exc_info=True)


def readings() -> list[dict]:
    """Every live device's reading, ``device`` added, sorted by device."""
    connection = get_redis_connection("default")
    keys = sorted(connection.scan_iter(match=KEY_PREFIX + "*", count=100))
    out = []
    for key, raw in zip(keys, connection.mget(keys) if keys else []):
        if raw is None:
            continue
        reading = json.loads(raw)
        reading["device"] = (key.decode() if isinstance(key, bytes) else key)[len(KEY_PREFIX):]
        reading["hit_rate"] = reading["hits"] / reading["lookups"] if reading["lookups"] else None
        reading["reused_share"] = reading["hit_tokens"] / reading["lookup_tokens"] if reading["lookup_tokens"] else None
        out.append(reading)
    return out
