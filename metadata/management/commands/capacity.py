"""Print the capacity plan: observed average and peak load, and what the peak times a buffer needs.

    manage.py capacity [--hours 24] [--buffer 2.5] [--bucket-seconds 60]

Numbers come from the pg_stat_statements snapshots (beat: ``metadata.insights.snapshot_statements``),
the token and session tables and pg_catalog (``metadata.insights.capacity``). A mistake in the
options is one line on stderr and exit status 1 (2 for an unknown option, as argparse does).
"""
from __future__ import annotations

import math

from django.core.management.base import BaseCommand, CommandError, CommandParser

from metadata.conf import conf
from metadata.insights import capacity_plan
from metadata.insights.capacity import DEFAULT_BUCKET_S, MIN_BUFFER
from metadata.management.commands.partitions import OneLineErrorParser

MAX_HOURS = 24 * 90  # the snapshots' retention is the partitions' (30 days by default)


def _number(name: str, raw: str, low: float, high: float, integer: bool = False) -> float:
    """``raw`` as a number in [low, high], else the command's one-line error naming the option."""
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise CommandError(f"capacity: {name} must be {kind}, got {raw!r}") from None
    if not (math.isfinite(value) and low <= value <= high):
        raise CommandError(f"capacity: {name} must be between {low:g} and {high:g}, got {raw}")
    return value


class Command(BaseCommand):
    help = "Capacity plan: average and peak statements/s, tokens/s, sessions/s, IOPS, storage; needs with a buffer."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.__class__ = OneLineErrorParser
        parser.add_argument("--hours", default="24", help="window of observations, ending now (default 24)")
        parser.add_argument("--buffer", default=None,
                            help=f"multiple of the observed peak to plan for (default SPECOPS_CAPACITY_BUFFER, "
                                 f"{conf.CAPACITY_BUFFER:g}; 2-3 is usual)")
        parser.add_argument("--bucket-seconds", default=str(DEFAULT_BUCKET_S),
                            help="bucket of the tokens/s and sessions/s peaks (default 60)")

    def handle(self, *args, hours: str, buffer: str | None, bucket_seconds: str, **options) -> None:
        window_hours = _number("--hours", hours, 1 / 60, MAX_HOURS)
        factor = _number("--buffer", buffer, MIN_BUFFER, 100) if buffer is not None else None
        bucket = int(_number("--bucket-seconds", bucket_seconds, 1, 86400, integer=True))
        plan = capacity_plan(hours=window_hours, buffer=factor, bucket_s=bucket)
        for line in plan.lines():
            self.stdout.write(line)
