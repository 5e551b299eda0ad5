"""Settings of the metadata store: each one declared here once, with its type and default.

``specops/settings.py`` reads them from the environment; code reads ``metadata.conf.conf.NAME``.
The partition policy and cache configuration are validated at start-up by ``metadata/checks.py``.
"""
from __future__ import annotations

import os
from pathlib import Path

from core.conf_base import AppSettings, Setting

BASE_DIR = Path(__file__).resolve().parent.parent

SETTINGS = (
    Setting("SPECOPS_MODEL_DIR", Path, BASE_DIR / "models",
            "where model directories live (a model version's relative path is relative to it)"),
    Setting("SPECOPS_ARCHIVE_DIR", Path, BASE_DIR / "var" / "archive", "cold-storage folder of archived partitions"),
    Setting("SPECOPS_TOKEN_BATCH_SIZE", int, 100, "rows per INSERT of token and candidate history"),
    Setting("SPECOPS_PARTITION_INTERVAL", str, "daily", "partition width: hourly, daily, weekly, <n>h or <n>d"),
    Setting("SPECOPS_PARTITION_PREMAKE", int, 4, "partitions made ahead of now"),
    Setting("SPECOPS_PARTITION_RETENTION_DAYS", float, 30.0, "age after which a partition is archived"),
    Setting("SPECOPS_PARTITION_ROTATE_MINUTES", int, 60, "beat period of partition rotation"),
    Setting("SPECOPS_RECENT_ACTIVITY_MINUTES", int, 30, "window of the recent-activity index"),
    Setting("SPECOPS_RECENT_INDEX_ROTATE_MINUTES", int, 10, "beat period of the recent-activity index rebuild"),
    Setting("SPECOPS_MAINTENANCE_LOCK_TIMEOUT_MS", int, 500, "lock_timeout of maintenance DDL"),
    Setting("SPECOPS_MAINTENANCE_LOCK_RETRIES", int, 30, "retries of maintenance DDL after a lock timeout"),
    Setting("SPECOPS_MAINTENANCE_PAUSE_RATIO", float, 2.0, "archival sleeps this many times its work time"),
    Setting("SPECOPS_REPLICA_PROBE_TTL_S", float, 0.5, "how long a replica health probe is reused"),
    Setting("SPECOPS_REPLICA_MAX_LAG_BYTES", int, 16 * 1024 * 1024, "replay lag past which a replica is skipped"),
    Setting("SPECOPS_REPLICA_MAX_PROBE_MS", float, 100.0, "probe latency past which a replica is skipped"),
    Setting("SPECOPS_PROBE_DATABASE", str, "postgres", "database the replica probes connect to"),
    Setting("SPECOPS_EXPOSE_READ_DB", bool, lambda ns: ns.get("DEBUG", False),
            "send the X-SpecOps-Read-DB header (default: DEBUG)"),
    Setting("SPECOPS_CACHE_LOCAL_TTL_S", float, 1.0, "in-process cache entry lifetime"),
    Setting("SPECOPS_CACHE_LOCAL_MAXSIZE", int, 10_000, "in-process cache entries per cache"),
    Setting("SPECOPS_CACHE_REDIS_TTL_S", float, 45.0, "Redis cache entry lifetime"),
    Setting("SPECOPS_CACHE_LOCK_TTL_S", float, 2.0, "single-flight load lock lifetime"),
    Setting("SPECOPS_CACHE_REDIS_RETRY_S", float, 0.5, "pause before Redis is tried again after a failure"),
    Setting("SPECOPS_CACHE_STATS_FLUSH_S", float, 5.0, "how often a process adds its cache counters to Redis"),
    Setting("SPECOPS_INSIGHTS_SNAPSHOT_MINUTES", int, 1, "beat period of the pg_stat_statements snapshot"),
    Setting("SPECOPS_INSIGHTS_BIG_TABLE_ROWS", int, 100_000,
            "a sequential scan of a relation with at least this many rows (estimate) is flagged"),
    Setting("SPECOPS_CAPACITY_BUFFER", float, 2.5, "headroom over the observed peak in the capacity plan"),
    Setting("SPECOPS_CAPACITY_DEVICE_TOKENS_PER_S", float, 275.0,
            "measured tokens/s of one worker device (bench/engine.py; the CPU demo pair: 275)"),
    Setting("SPECOPS_CAPACITY_DB_CORES", int, lambda ns: os.cpu_count() or 1,
            "CPU cores of one database server (default: this host's)"),
    Setting("SPECOPS_CAPACITY_DISK_FREE_BYTES", int, 0,
            "free bytes for the database (0: measure the data directory when readable)"),
    Setting("SPECOPS_TENANT_MAX_LIVE_GENERATIONS", int, 64,
            "generations one tenant may have queued or running at once, past which a submission is a 429 "
            "(0: no limit; a tenant's own limit in the admin wins)"),
    Setting("SPECOPS_TENANT_MAX_OPEN_STREAMS", int, 200,
            "session streams (/api/v1/sessions/<id>/stream/) one tenant may hold open at once, past which one "
            "more is a 429 (0: no limit; a tenant's own limit in the admin wins)"),
)

conf = AppSettings(SETTINGS)
