"""The time window a report covers: ``(start, end]`` in UTC, snapshots taken in it included."""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.utils import timezone

WINDOW_CHOICES_HOURS = (1, 6, 24, 72, 168)


@dataclass(frozen=True)
class Window:
    start: dt.datetime
    end: dt.datetime

    @classmethod
    def last(cls, hours: float, now: dt.datetime | None = None) -> Window:
        if not hours > 0:
            raise ValueError(f"a window needs a positive number of hours, got {hours!r}")
        end = now or timezone.now()
        return cls(end - dt.timedelta(hours=hours), end)

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()

    @property
    def hours(self) -> float:
        return self.seconds / 3600

    def label(self) -> str:
        return f"{self.start:%Y-%m-%d %H:%M} .. {self.end:%Y-%m-%d %H:%M} UTC ({self.hours:g} h)"
