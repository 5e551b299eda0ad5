"""Build DATABASES from URLs: a pooled primary, zero or more read replicas, and a direct alias.

Kept apart from settings.py so the parsing can be unit-tested and so a bad replica URL becomes
a system check (specops.E001) instead of a traceback at import time.

A URL may point at PgBouncer in transaction pooling mode; say so with the URL option
``?pgbouncer=true``. No session state survives a transaction there, so such an alias gets no
prepared statements (``prepare_threshold=None``) and no server-side cursors, and maintenance
that needs a session (advisory locks, ``SET lock_timeout``, ``... CONCURRENTLY``) uses the
``direct`` alias, built from ``DATABASE_DIRECT_URL`` (a connection straight to the primary).
Without it the primary itself is direct (``maintenance_alias()`` is then ``default``); a
PgBouncer primary with no direct URL is system check specops.E002.
"""
from __future__ import annotations

from typing import Any

import environ
from django.core.exceptions import ImproperlyConfigured

REPLICA_ALIAS_PREFIX = "replica_"
DIRECT_ALIAS = "direct"
PGBOUNCER_OPTION = "pgbouncer"
TRUE_WORDS = ("1", "true", "yes", "on")


def _parse(url: str, pool_max_size: int, pooled: bool = True) -> dict[str, Any]:
    config = environ.Env.db_url_config(url)
    if config.get("ENGINE") != "django.db.backends.postgresql":
        raise ValueError(f"{url!r} is not a postgres:// URL")
    if not config.get("NAME"):
        raise ValueError(f"{url!r} names no database")
    # Other URL options are libpq's (sslmode=..., connect_timeout=...) and go to psycopg as they are.
    options = dict(config.get("OPTIONS", {}))
    behind_pgbouncer = str(options.pop(PGBOUNCER_OPTION, "")).lower() in TRUE_WORDS
    options.pop("pool", None)
    # django-prometheus's wrapper of the same backend: query counts and latencies per alias.
    config["ENGINE"] = "django_prometheus.db.backends.postgresql"
    config["CONN_MAX_AGE"] = 0  # required by the native pool (and the direct alias closes after use)
    if pooled:
        options["pool"] = {"min_size": 1, "max_size": pool_max_size, "timeout": 10}
    config["OPTIONS"] = options
    if behind_pgbouncer:
        config["OPTIONS"]["prepare_threshold"] = None  # a prepared statement lives in one server session
        config["DISABLE_SERVER_SIDE_CURSORS"] = True  # so does a cursor (QuerySet.iterator())
    config["PGBOUNCER"] = behind_pgbouncer
    return config


def behind_pgbouncer(config: dict[str, Any]) -> bool:
    """Whether an alias's connections go through a transaction-mode pooler (the URL said so)."""
    return bool(config.get("PGBOUNCER"))


def database_settings(
    primary_url: str, replica_urls: str, pool_max_size: int, errors: list[tuple[str, str, str]],
    direct_url: str = "",
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
    _add_direct(databases, direct_url.strip(), errors)
    return databases, aliases


def _add_direct(databases: dict[str, dict[str, Any]], direct_url: str, errors: list[tuple[str, str, str]]) -> None:
    """The ``direct`` alias: the same database as ``default``, never through a pooler, never pooled.

    Unpooled on purpose: maintenance holds it for one run, and a pooled connection handed back
    with session state (a lock, a ``SET``) would leak that state to the next borrower.
    """
    if not direct_url:
        if behind_pgbouncer(databases["default"]):
            errors.append((
                "specops.E002",
                "DATABASE_URL goes through PgBouncer (pgbouncer=true) but DATABASE_DIRECT_URL is not set: "
                "maintenance (advisory locks, SET lock_timeout, CONCURRENTLY) needs a session of its own.",
                "Set DATABASE_DIRECT_URL to a postgres:// URL of the primary itself (not PgBouncer's port).",
            ))
        return
    try:
        config = _parse(direct_url, 0, pooled=False)
    except Exception as exc:
        errors.append(("specops.E002", f"DATABASE_DIRECT_URL {direct_url!r} does not parse: {exc}",
                       "Use postgres://user@host:port/dbname of the primary, or leave it unset."))
        return
    if behind_pgbouncer(config):
        errors.append(("specops.E002", f"DATABASE_DIRECT_URL {direct_url!r} says pgbouncer=true",
                       "The direct URL must reach the primary itself, without a transaction pooler."))
        return
    config["TEST"] = {"MIRROR": "default"}  # the same (test) database as the primary
    databases[DIRECT_ALIAS] = config


def maintenance_alias(databases: dict[str, dict[str, Any]]) -> str:
    """The alias for work that needs session state: ``direct`` when configured, else ``default``."""
    return DIRECT_ALIAS if DIRECT_ALIAS in databases else "default"
