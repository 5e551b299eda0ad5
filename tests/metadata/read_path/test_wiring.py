"""The read path is wired into the project, not only into these tests: checked in a fresh
process, because importing the modules here would connect their signal receivers anyway."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.paths import REPO_ROOT
from tests.metadata.read_path.conftest import READ_PATH_MIDDLEWARE, REQUEST_LOG_MIDDLEWARE

PROBE = """
import json, sys, django
django.setup()
from django.conf import settings
print(json.dumps({
    "middleware": list(settings.MIDDLEWARE),
    "router": settings.DATABASE_ROUTERS,
    # Imported by the apps' ready(): their signal receivers (cache invalidation on Session save,
    # prediction cache on promotion) are connected in every process, workers included.
    "imported_at_setup": [m for m in ("sessions.state.cache", "sessions.submission.prediction_cache")
                          if m in sys.modules],
}))
"""


def test_middleware_router_and_signal_receivers_are_installed():
    root = REPO_ROOT
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "specops.settings"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    wiring = json.loads(out.strip().splitlines()[-1])
    assert wiring["router"] == ["metadata.replicas.router.ReplicaRouter"]
    middleware = wiring["middleware"]
    assert READ_PATH_MIDDLEWARE in middleware, "add it to specops/settings.py MIDDLEWARE"
    if REQUEST_LOG_MIDDLEWARE in middleware:  # the request log's own write is not the client's write
        assert middleware.index(READ_PATH_MIDDLEWARE) > middleware.index(REQUEST_LOG_MIDDLEWARE)
    assert "sessions.state.cache" in wiring["imported_at_setup"], "SessionsConfig.ready() must import it"
    assert "sessions.submission.prediction_cache" in wiring["imported_at_setup"], "SessionsConfig.ready() must import it"
