"""System checks of the metadata store's settings (stable ids: metadata.E0xx), run at start-up.

Checked at start-up, a bad partition interval stops the process at once instead of at beat's
first rotation, and a zero TTL is named instead of showing as a cache that never hits. Values
are read through ``metadata.conf.conf`` and each rule names its setting, the rule and the
default in its hint. Registered by ``MetadataConfig.ready()``.

    metadata.E001  SPECOPS_PARTITION_INTERVAL does not parse
    metadata.E002  SPECOPS_PARTITION_PREMAKE below 1
    metadata.E003  SPECOPS_PARTITION_RETENTION_DAYS not above 0
    metadata.E004  retention not longer than one partition interval
    metadata.E005  SPECOPS_PARTITION_ROTATE_MINUTES below 1
    metadata.E006  SPECOPS_CACHE_LOCAL_TTL_S not above 0
    metadata.E007  SPECOPS_CACHE_REDIS_TTL_S not above 0
    metadata.E008  SPECOPS_CACHE_LOCAL_MAXSIZE below 1
    metadata.E009  SPECOPS_CACHE_LOCK_TTL_S not above 0
    metadata.E010  SPECOPS_CACHE_REDIS_RETRY_S below 0
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from django.core.checks import CheckMessage, Error

from metadata.conf import conf
from metadata.partitions.bounds import parse_interval, width_text
from metadata.partitions.errors import BadIntervalError


def _default(setting: str) -> Any:
    return next(s.default for s in conf.declared() if s.name == setting)


def _number(value: Any) -> float | None:
    """``value`` as a number, or None when it is not one (bools are not numbers here)."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Minimum:
    """``setting`` must be a number at least ``minimum`` (``exclusive``: greater than it)."""

    setting: str
    minimum: float
    check_id: str
    why: str
    exclusive: bool = False

    def problems(self) -> list[CheckMessage]:
        value = getattr(conf, self.setting)
        number = _number(value)
        if number is not None and (number > self.minimum if self.exclusive else number >= self.minimum):
            return []
        rule = f"{'greater than' if self.exclusive else 'at least'} {self.minimum:g}"
        return [Error(f"{self.setting} is {value!r}; it must be a number {rule}.",
                      hint=f"{self.why} The default is {_default(self.setting)}.", id=self.check_id)]


PARTITION_MINIMUMS = (
    Minimum("SPECOPS_PARTITION_PREMAKE", 1, "metadata.E002",
            "Partitions made ahead of now; with none, the next bin's rows land in DEFAULT."),
    Minimum("SPECOPS_PARTITION_RETENTION_DAYS", 0, "metadata.E003",
            "Days a partition is kept before it is archived.", exclusive=True),
    Minimum("SPECOPS_PARTITION_ROTATE_MINUTES", 1, "metadata.E005",
            "Beat runs the partition rotation every this many minutes."),
)

CACHE_MINIMUMS = (
    Minimum("SPECOPS_CACHE_LOCAL_TTL_S", 0, "metadata.E006",
            "Seconds an in-process entry lives; 0 or less caches nothing.", exclusive=True),
    Minimum("SPECOPS_CACHE_REDIS_TTL_S", 0, "metadata.E007",
            "Seconds a Redis entry lives; 0 or less caches nothing.", exclusive=True),
    Minimum("SPECOPS_CACHE_LOCAL_MAXSIZE", 1, "metadata.E008",
            "Entries the in-process tier holds per cache."),
    Minimum("SPECOPS_CACHE_LOCK_TTL_S", 0, "metadata.E009",
            "Seconds a single-flight load lock is held at most; 0 or less never coalesces.", exclusive=True),
    Minimum("SPECOPS_CACHE_REDIS_RETRY_S", 0, "metadata.E010",
            "Seconds Redis is skipped after a failure (0: try again at once)."),
)


def check_interval() -> list[CheckMessage]:
    try:
        parse_interval(str(conf.PARTITION_INTERVAL))
    except BadIntervalError as exc:
        default = _default("SPECOPS_PARTITION_INTERVAL")
        return [Error(f"SPECOPS_PARTITION_INTERVAL: {exc}.",
                      hint="Use hourly, daily, weekly, '<n>h' or '<n>d' with a width that divides a week or is "
                           f"whole weeks (months are not fixed widths). The default is {default}.",
                      id="metadata.E001")]
    return []


def check_retention_covers_an_interval() -> list[CheckMessage]:
    """Retention must outlast one partition, or a partition is archived as soon as it ends."""
    days = _number(conf.PARTITION_RETENTION_DAYS)
    try:
        interval = parse_interval(str(conf.PARTITION_INTERVAL))
    except BadIntervalError:
        return []  # metadata.E001 says so
    if days is None or days <= 0 or dt.timedelta(days=days) > interval:
        return []  # metadata.E003 covers a non-positive retention
    return [Error(f"SPECOPS_PARTITION_RETENTION_DAYS ({days:g} days) is not longer than one partition "
                  f"({width_text(interval)}: SPECOPS_PARTITION_INTERVAL={conf.PARTITION_INTERVAL!r}).",
                  hint="Keep partitions longer than one interval: raise the retention or narrow the interval.",
                  id="metadata.E004")]


def check_partition_policy(app_configs=None, **kwargs) -> list[CheckMessage]:
    """The SPECOPS_PARTITION_* settings: interval, premake, retention, rotation period."""
    errors = check_interval() + check_retention_covers_an_interval()
    for rule in PARTITION_MINIMUMS:
        errors += rule.problems()
    return sorted(errors, key=lambda e: e.id)


def check_cache_configuration(app_configs=None, **kwargs) -> list[CheckMessage]:
    """The SPECOPS_CACHE_* settings: TTLs, local size, lock TTL, Redis retry pause."""
    errors = []
    for rule in CACHE_MINIMUMS:
        errors += rule.problems()
    return errors
