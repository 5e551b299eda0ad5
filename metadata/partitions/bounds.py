"""Partition ranges as UTC half-open intervals: the interval setting, bins, gaps and names.

Pure Python, no database: the lifecycle asks "which ranges must exist?" here and asks the
catalog (``metadata.partitions.catalog``) "which ranges do exist?". Bins are aligned on a fixed
UTC origin (a Monday at midnight), so daily, hourly and weekly partitions always start at the
same instants whatever the server's or the client's time zone is.
"""
from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from metadata.partitions.errors import BadIntervalError, BoundsError

UTC = dt.timezone.utc
# date_bin() origin in SQL and the bin origin here: Monday 2000-01-03 00:00 UTC.
BIN_ORIGIN = dt.datetime(2000, 1, 3, tzinfo=UTC)

_NAMED_INTERVALS = {"hourly": dt.timedelta(hours=1), "daily": dt.timedelta(days=1), "weekly": dt.timedelta(days=7)}
_INTERVAL_PATTERN = re.compile(r"^(\d+)\s*([hd])$")


def parse_interval(raw: str) -> dt.timedelta:
    """Parse ``hourly|daily|weekly`` or ``<n>h`` / ``<n>d`` into a bin width.

    Widths must divide a week or be whole weeks, so bins never straddle the origin's grid
    differently from one week to the next. Months are refused: they are not fixed widths.
    """
    text = raw.strip().lower()
    if text in _NAMED_INTERVALS:
        return _NAMED_INTERVALS[text]
    match = _INTERVAL_PATTERN.match(text)
    if not match or int(match.group(1)) == 0:
        raise BadIntervalError(
            f"partition interval {raw!r} is not hourly, daily, weekly, '<n>h' or '<n>d'"
        )
    width = dt.timedelta(hours=int(match.group(1))) if match.group(2) == "h" else dt.timedelta(days=int(match.group(1)))
    week = dt.timedelta(days=7)
    if not (week % width == dt.timedelta(0) or width % week == dt.timedelta(0)):
        raise BadIntervalError(f"partition interval {raw!r} must divide a week or be whole weeks")
    return width


def width_text(width: dt.timedelta) -> str:
    """A bin width for people: ``6 h``, ``1 day``, ``7 days``."""
    hours = width / dt.timedelta(hours=1)
    if hours % 24:
        return f"{hours:g} h"
    days = int(hours // 24)
    return f"{days} day" if days == 1 else f"{days} days"


def as_utc(moment: dt.datetime) -> dt.datetime:
    """Return ``moment`` in UTC; a naive datetime is refused rather than guessed."""
    if moment.tzinfo is None:
        raise BoundsError(f"naive datetime {moment.isoformat()} has no time zone")
    return moment.astimezone(UTC)


def bin_start(moment: dt.datetime, width: dt.timedelta) -> dt.datetime:
    """The start of the bin holding ``moment`` (same as SQL ``date_bin(width, moment, origin)``)."""
    offset = as_utc(moment) - BIN_ORIGIN
    return BIN_ORIGIN + (offset // width) * width


@dataclass(frozen=True, order=True)
class TimeRange:
    """A half-open UTC range ``[start, end)``, the shape of every RANGE partition bound."""

    start: dt.datetime
    end: dt.datetime

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", as_utc(self.start))
        object.__setattr__(self, "end", as_utc(self.end))
        if self.end <= self.start:
            raise BoundsError(f"empty range [{self.start.isoformat()}, {self.end.isoformat()})")

    def overlaps(self, other: TimeRange) -> bool:
        return self.start < other.end and other.start < self.end

    def contains(self, moment: dt.datetime) -> bool:
        return self.start <= as_utc(moment) < self.end

    def __str__(self) -> str:
        return f"[{self.start.isoformat()}, {self.end.isoformat()})"


def bins(start: dt.datetime, end: dt.datetime, width: dt.timedelta) -> Iterator[TimeRange]:
    """Aligned bins from the one holding ``start`` up to (excluding) the one starting at ``end``."""
    cursor = bin_start(start, width)
    while cursor < as_utc(end):
        yield TimeRange(cursor, cursor + width)
        cursor += width


def uncovered(wanted: TimeRange, existing: Iterable[TimeRange]) -> list[TimeRange]:
    """The parts of ``wanted`` no existing range covers (so a changed interval never overlaps)."""
    gaps: list[TimeRange] = []
    cursor = wanted.start
    for taken in sorted(r for r in existing if r.overlaps(wanted)):
        if taken.start > cursor:
            gaps.append(TimeRange(cursor, taken.start))
        cursor = max(cursor, taken.end)
        if cursor >= wanted.end:
            break
    if cursor < wanted.end:
        gaps.append(TimeRange(cursor, wanted.end))
    return gaps


def partition_name(parent_table: str, bounds: TimeRange) -> str:
    """A readable name such as ``metadata_token_p20260101`` (names are for people only).

    The lifecycle finds partitions by their bounds, never by this name, so a clash (an old
    restored table, say) is resolved by the caller with a suffix.
    """
    start = bounds.start
    if start.hour == 0 and start.minute == 0:
        stamp = start.strftime("%Y%m%d")
    else:
        stamp = start.strftime("%Y%m%d_%H%M")
    return f"{parent_table}_p{stamp}"[:63]
