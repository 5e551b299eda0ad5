"""Settings of a session's life: each one declared here once, with its type and default.

``specops/settings.py`` reads them from the environment; code reads ``sessions.conf.conf.NAME``
(serving reads the lease through ``inference.conf``, which shares it).
"""
from __future__ import annotations

from core.conf_base import AppSettings, Setting

SETTINGS = (
    Setting("SPECOPS_SESSION_LEASE_S", float, 30.0,
            "a running session whose worker has not renewed its lease for this long is re-enqueued"),
    Setting("SPECOPS_MAX_ATTEMPTS", int, 3, "runs of one session (first run and resumes) before it fails"),
    Setting("SPECOPS_RECONCILE_QUEUED_S", float, 60.0,
            "a session queued this long since its last enqueue gets another task (the broker may have lost it)"),
    Setting("SPECOPS_RECONCILE_GIVE_UP_S", float, 3600.0,
            "a session still queued this long after its creation fails (no worker took it)"),
    Setting("SPECOPS_PREDICTION_CACHE_TTL_S", int, 3600, "lifetime of a cached deterministic result"),
)

conf = AppSettings(SETTINGS)
