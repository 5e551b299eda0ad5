"""Bins, gaps and names of partition ranges: pure functions, no database."""
from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import pytest

from metadata.partitions.bounds import (
    BadIntervalError,
    TimeRange,
    bin_start,
    bins,
    parse_interval,
    partition_name,
    uncovered,
)

UTC = dt.timezone.utc
DAY = dt.timedelta(days=1)


@pytest.mark.parametrize(
    "raw, width",
    [("daily", DAY), ("hourly", dt.timedelta(hours=1)), ("weekly", dt.timedelta(days=7)), ("6h", dt.timedelta(hours=6)),
     ("7d", dt.timedelta(days=7)), (" Daily ", DAY)],
)
def test_parse_interval_accepts_fixed_widths(raw: str, width: dt.timedelta) -> None:
    assert parse_interval(raw) == width


@pytest.mark.parametrize("raw", ["monthly", "0d", "5h", "3d", "", "1w"])
def test_parse_interval_refuses_widths_that_do_not_tile_a_week(raw: str) -> None:
    with pytest.raises(BadIntervalError):
        parse_interval(raw)


def test_bin_start_is_utc_midnight_whatever_the_input_zone() -> None:
    # 23:30 on Jan 1 in New York is 04:30 UTC on Jan 2: the UTC day is what counts.
    moment = dt.datetime(2030, 1, 1, 23, 30, tzinfo=ZoneInfo("America/New_York"))
    assert bin_start(moment, DAY) == dt.datetime(2030, 1, 2, tzinfo=UTC)
    assert bin_start(moment, dt.timedelta(days=7)).weekday() == 0  # weeks start on Monday


def test_naive_datetimes_are_refused() -> None:
    with pytest.raises(ValueError, match="naive"):
        bin_start(dt.datetime(2030, 1, 1), DAY)


def test_bins_cover_the_span_contiguously() -> None:
    start = dt.datetime(2030, 1, 1, 12, tzinfo=UTC)
    result = list(bins(start, start + 3 * DAY, DAY))
    assert [r.start.day for r in result] == [1, 2, 3, 4]
    assert all(a.end == b.start for a, b in zip(result, result[1:]))


def test_uncovered_returns_only_the_gaps() -> None:
    wanted = TimeRange(dt.datetime(2030, 1, 1, tzinfo=UTC), dt.datetime(2030, 1, 2, tzinfo=UTC))
    existing = [
        TimeRange(dt.datetime(2029, 12, 31, 18, tzinfo=UTC), dt.datetime(2030, 1, 1, 6, tzinfo=UTC)),
        TimeRange(dt.datetime(2030, 1, 1, 12, tzinfo=UTC), dt.datetime(2030, 1, 1, 18, tzinfo=UTC)),
    ]
    assert uncovered(wanted, existing) == [
        TimeRange(dt.datetime(2030, 1, 1, 6, tzinfo=UTC), dt.datetime(2030, 1, 1, 12, tzinfo=UTC)),
        TimeRange(dt.datetime(2030, 1, 1, 18, tzinfo=UTC), dt.datetime(2030, 1, 2, tzinfo=UTC)),
    ]
    assert uncovered(wanted, [wanted]) == []


def test_partition_names_are_readable_and_fit_postgres() -> None:
    daily = TimeRange(dt.datetime(2030, 1, 2, tzinfo=UTC), dt.datetime(2030, 1, 3, tzinfo=UTC))
    hourly = TimeRange(dt.datetime(2030, 1, 2, 5, tzinfo=UTC), dt.datetime(2030, 1, 2, 6, tzinfo=UTC))
    assert partition_name("metadata_token", daily) == "metadata_token_p20300102"
    assert partition_name("metadata_token", hourly) == "metadata_token_p20300102_0500"
    assert len(partition_name("x" * 80, daily)) == 63
