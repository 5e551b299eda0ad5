"""How partitions are cut and kept: the interval, how many are made ahead, the retention."""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from metadata.conf import conf
from metadata.partitions.bounds import parse_interval, width_text
from metadata.partitions.errors import PartitionPolicyError


@dataclass(frozen=True)
class PartitionPolicy:
    """How partitions are cut and kept; read from settings, overridable in tests and commands."""

    interval: dt.timedelta = dt.timedelta(days=1)
    premake: int = 4
    retention: dt.timedelta = dt.timedelta(days=30)
    drain_batch_rows: int = 5000
    max_default_bins: int = 100  # bins of stranded rows drained per run, against a flood of bad timestamps
    max_archives_per_run: int = 50

    @classmethod
    def from_settings(cls) -> PartitionPolicy:
        """Build the policy from SPECOPS_PARTITION_* settings.

        ``metadata.checks`` reports bad values at start-up with ids and hints; this refuses them
        again (``PartitionPolicyError``) for a process that skipped the checks.
        """
        try:
            interval = parse_interval(str(conf.PARTITION_INTERVAL))
        except PartitionPolicyError as exc:
            raise type(exc)(f"SPECOPS_PARTITION_INTERVAL: {exc}") from exc
        premake = int(conf.PARTITION_PREMAKE)
        retention_days = float(conf.PARTITION_RETENTION_DAYS)
        if premake < 1:
            raise PartitionPolicyError("SPECOPS_PARTITION_PREMAKE must be at least 1")
        if retention_days <= 0:
            raise PartitionPolicyError("SPECOPS_PARTITION_RETENTION_DAYS must be positive")
        return cls(interval=interval, premake=premake, retention=dt.timedelta(days=retention_days))

    def describe(self) -> str:
        """E.g. ``1 day interval, 4 made ahead, retention 30 days``."""
        retention_days = self.retention / dt.timedelta(days=1)
        return (f"{width_text(self.interval)} interval, {self.premake} made ahead, "
                f"retention {retention_days:g} day{'s' if retention_days != 1 else ''}")

