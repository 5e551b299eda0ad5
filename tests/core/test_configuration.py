"""Settings come from the environment; misconfiguration is refused or reported clearly."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.core.exceptions import ImproperlyConfigured

from core.database_config import database_settings
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


def test_replica_urls_become_mirrored_pooled_aliases():
    errors: list = []
    databases, aliases = database_settings(
        "postgres://u@db1:5432/app", "postgres://u@r1:5433/app, postgres://u@r2:5434/app", 5, errors)
    assert aliases == ["replica_0", "replica_1"]
    assert databases["replica_1"]["PORT"] == 5434
    assert databases["replica_0"]["TEST"] == {"MIRROR": "default"}
    assert databases["default"]["OPTIONS"]["pool"]["max_size"] == 5
    assert errors == []


def test_bad_replica_url_is_reported_not_used():
    errors: list = []
    databases, aliases = database_settings("postgres://u@db1/app", "mysql://u@r1/app,postgres://u@r2/app", 5, errors)
    assert aliases == ["replica_0"] and databases["replica_0"]["HOST"] == "r2"
    assert errors[0][0] == "specops.E001" and "mysql://u@r1/app" in errors[0][1]


def test_bad_primary_url_is_refused():
    with pytest.raises(ImproperlyConfigured, match="DATABASE_URL"):
        database_settings("not-a-url", "", 5, [])


def test_system_check_names_the_bad_replica_url():
    result = manage("check", DATABASE_REPLICA_URLS="redis://127.0.0.1:6379/0")
    assert result.returncode != 0
    assert "specops.E001" in result.stderr and "redis://127.0.0.1:6379/0" in result.stderr
    assert "HINT" in result.stderr


def test_system_check_names_a_bad_prefill_mode():
    result = manage("check", SPECOPS_PREFILL="seperate")
    assert result.returncode != 0
    assert "specops.E003" in result.stderr and "'seperate'" in result.stderr and "shared" in result.stderr
    assert manage("check", SPECOPS_PREFILL="shared").returncode == 0


def test_debug_off_refuses_the_default_secret_key():
    env = {k: v for k, v in os.environ.items() if k != "SECRET_KEY"}
    result = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, capture_output=True, text=True,
                            env={**env, "DEBUG": "false"}, timeout=120)
    assert result.returncode != 0 and "SECRET_KEY must be set" in result.stderr


def test_debug_off_with_a_secret_key_passes_checks():
    result = manage("check", DEBUG="false", SECRET_KEY="s3cret-for-the-test-only-0123456789abcdef")
    assert result.returncode == 0, result.stderr
