"""System checks of the partition policy and the cache configuration (metadata.E0xx)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.test import override_settings

from metadata.checks import check_cache_configuration, check_partition_policy


def ids(messages) -> list[str]:
    return [m.id for m in messages]


def test_the_defaults_pass() -> None:
    assert check_partition_policy() == [] and check_cache_configuration() == []


def test_the_checks_are_registered_under_their_tags() -> None:
    with override_settings(SPECOPS_PARTITION_INTERVAL="fortnightly", SPECOPS_CACHE_LOCAL_MAXSIZE=0):
        assert [i for i in ids(run_checks(tags=["partitions"])) if i.startswith("metadata.")] == ["metadata.E001"]
        assert [i for i in ids(run_checks(tags=["caches"])) if i.startswith("metadata.")] == ["metadata.E008"]


@pytest.mark.parametrize(
    "name, value, check_id",
    [
        ("SPECOPS_PARTITION_INTERVAL", "fortnightly", "metadata.E001"),
        ("SPECOPS_PARTITION_INTERVAL", "monthly", "metadata.E001"),
        ("SPECOPS_PARTITION_INTERVAL", "5h", "metadata.E001"),
        ("SPECOPS_PARTITION_PREMAKE", 0, "metadata.E002"),
        ("SPECOPS_PARTITION_RETENTION_DAYS", 0, "metadata.E003"),
        ("SPECOPS_PARTITION_RETENTION_DAYS", -3.0, "metadata.E003"),
        ("SPECOPS_PARTITION_RETENTION_DAYS", "thirty", "metadata.E003"),
        ("SPECOPS_PARTITION_RETENTION_DAYS", 1.0, "metadata.E004"),  # = one daily partition
        ("SPECOPS_PARTITION_ROTATE_MINUTES", 0, "metadata.E005"),
    ],
)
def test_a_bad_partition_setting_is_reported_by_id(name, value, check_id) -> None:
    with override_settings(**{name: value}):
        messages = check_partition_policy()
    assert ids(messages) == [check_id]
    assert name in messages[0].msg and messages[0].hint


def test_retention_must_outlast_the_interval_it_is_paired_with() -> None:
    with override_settings(SPECOPS_PARTITION_INTERVAL="weekly", SPECOPS_PARTITION_RETENTION_DAYS=7.0):
        assert ids(check_partition_policy()) == ["metadata.E004"]
    with override_settings(SPECOPS_PARTITION_INTERVAL="6h", SPECOPS_PARTITION_RETENTION_DAYS=0.5):
        assert check_partition_policy() == []


@pytest.mark.parametrize(
    "name, value, check_id",
    [
        ("SPECOPS_CACHE_LOCAL_TTL_S", 0.0, "metadata.E006"),
        ("SPECOPS_CACHE_REDIS_TTL_S", -1.0, "metadata.E007"),
        ("SPECOPS_CACHE_LOCAL_MAXSIZE", 0, "metadata.E008"),
        ("SPECOPS_CACHE_LOCK_TTL_S", 0.0, "metadata.E009"),
        ("SPECOPS_CACHE_REDIS_RETRY_S", -0.5, "metadata.E010"),
    ],
)
def test_a_bad_cache_setting_is_reported_by_id(name, value, check_id) -> None:
    with override_settings(**{name: value}):
        messages = check_cache_configuration()
    assert ids(messages) == [check_id]
    assert name in messages[0].msg and "default" in messages[0].hint


def test_a_redis_retry_of_zero_is_allowed() -> None:
    with override_settings(SPECOPS_CACHE_REDIS_RETRY_S=0.0):
        assert check_cache_configuration() == []


def test_manage_check_fails_at_start_up_naming_the_id() -> None:
    env = {**os.environ, "SPECOPS_PARTITION_INTERVAL": "fortnightly", "DATABASE_REPLICA_URLS": ""}
    result = subprocess.run([sys.executable, "manage.py", "check"], cwd=settings.BASE_DIR, env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    assert "(metadata.E001) SPECOPS_PARTITION_INTERVAL: partition interval 'fortnightly'" in result.stderr
