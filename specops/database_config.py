"""Build DATABASES from URLs: a pooled primary and zero or more read replicas.

Kept apart from settings.py so the parsing can be unit-tested and so a bad replica URL becomes
a system check (specops.E001) instead of a traceback at import time.
"""
from __future__ import annotations

from typing import Any

import environ
from django.core.exceptions import ImproperlyConfigured

REPLICA_ALIAS_PREFIX = "replica_"


def _parse(url: str, pool_max_size: int) -> dict[str, Any]:
    config = environ.Env.db_url_config(url)
    if config.get("ENGINE") != "django.db.backends.postgresql":
        raise ValueError(f"{url!r} is not a postgres:// URL")
    if not config.get("NAME"):
        raise ValueError(f"{url!r} names no database")
    # django-prometheus's wrapper of the same backend: query counts and latencies per alias.
    config["ENGINE"] = "django_prometheus.db.backends.postgresql"
    config["CONN_MAX_AGE"] = 0  # required by the native pool
    config["OPTIONS"] = {"pool": {"min_size": 1, "max_size": pool_max_size, "timeout": 10}}
    return config


def database_settings(
    primary_url: str, replica_urls: str, pool_max_size: int, errors: list[tuple[str, str, str]]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Return (DATABASES, replica aliases); unparsable replica URLs are reported in ``errors``."""
    try:
        databases = {"default": _parse(primary_url, pool_max_size)}
    except Exception as exc:
        raise ImproperlyConfigured(f"DATABASE_URL does not parse: {exc}") from exc
    aliases: list[str] = []
    for raw in (part.strip() for part in replica_urls.split(",")):
        if not raw:
            continue
        try:
            config = _parse(raw, pool_max_size)
        except Exception as exc:  # environ raises several types for a malformed URL
            errors.append(
                (
                    "specops.E001",
                    f"DATABASE_REPLICA_URLS entry {raw!r} does not parse: {exc}",
                    "Use comma-separated postgres://user@host:port/dbname URLs, or leave it empty.",
                )
            )
            continue
        # Tests: the replica receives the test database through WAL, so it mirrors the primary's
        # test NAME while keeping its own host and port.
        config["TEST"] = {"MIRROR": "default"}
        # A replica that dies between two health probes must not stall a read for long: the
        # router falls back to the primary when a replica connection cannot be had in 1 s.
        config["OPTIONS"]["pool"]["timeout"] = 1
        # Replicas are restarted and rebuilt under us: the pool checks a connection before use.
        config["CONN_HEALTH_CHECKS"] = True
        alias = f"{REPLICA_ALIAS_PREFIX}{len(aliases)}"
        databases[alias] = config
        aliases.append(alias)
    return databases, aliases
