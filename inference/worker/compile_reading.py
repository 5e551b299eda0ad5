"""Each device's compiled forwards in Redis, for the operators' dashboard.

Which models of a device run compiled, which are still being compiled (and for how long so
far), which serve eagerly for good and why, and how many forwards each path ran. Prometheus has
the counts per process (metrics.py `specops_engine_*`); the admin dashboard, which reads no
Prometheus, shows the state from a short-lived Redis value per device that its front refreshes
while it steps (at most every `PUBLISH_EVERY_S`; it expires `TTL_S` after the last refresh).
"""
from __future__ import annotations

import json
import logging
import time

from django_redis import get_redis_connection

from inference.worker.prefix_cache_reading import device_name

logger = logging.getLogger(__name__)

KEY_PREFIX = "specops:compiled-forwards:"
PUBLISH_EVERY_S = 5.0
TTL_S = 60

_engines: dict[str, dict] = {}  # this front's engines: pair -> their runners, as last reported
_last_publish = 0.0


def _state(stats) -> str:
    if stats.fallback:
        return "eager"
    if stats.compiled:
        return "compiled"
    return "compiling" if stats.building else "eager until built"


def publish(pair, runners: dict) -> None:
    """Remember an engine's runner stats (`RunnerStats` by role) and refresh this device's reading
    (throttled; Redis errors are logged, not raised)."""
    global _last_publish
    _engines[str(pair)] = {
        role: {"state": _state(stats), "compiled": list(stats.compiled_kinds), "building": list(stats.building),
               "fallback": stats.fallback, "compiled_forwards": stats.forwards.get("compiled", 0),
               "eager_forwards": stats.forwards.get("eager", 0), "compile_seconds": round(stats.compile_seconds, 1),
               "cache_hits": stats.cache_hits, "cache_misses": stats.cache_misses}
        for role, stats in runners.items()}
    now = time.monotonic()
    if now - _last_publish < PUBLISH_EVERY_S:
        return
    _last_publish = now
    try:
        get_redis_connection("default").set(KEY_PREFIX + device_name(), json.dumps(_engines), ex=TTL_S)
    except Exception:  # the dashboard's reading is not worth failing a step for
        logger.warning("compiled-forward reading not published", exc_info=True)


def readings() -> list[dict]:
    """One row per (device, engine, role), sorted: what the dashboard's table shows."""
    client = get_redis_connection("default")
    rows = []
    for key in sorted(client.scan_iter(KEY_PREFIX + "*")):
        raw = client.get(key)
        if raw is None:
            continue
        device = (key.decode() if isinstance(key, bytes) else key).removeprefix(KEY_PREFIX)
        try:
            engines = json.loads(raw)
        except ValueError:
            continue
        for pair, roles in sorted(engines.items()):
            for role, state in sorted(roles.items()):
                rows.append({"device": device, "pair": pair, "role": role, **state})
    return rows
