"""What the ops app adds to other apps' admin pages: the model registry's acceptance chart.

The registry's page (``inference.admin.ModelVersionAdmin``) charts the acceptance of each
(target, draft) pair; the hourly ``pair`` rollups it reads are this app's, a floor above the
registry's, so the chart is drawn here and plugged into the page (admin autodiscovery imports
this module after ``inference.admin``).
"""
from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from core.charts import PALETTE, Series, line_chart
from inference.admin import ModelVersionAdmin
from metadata.models import ModelVersion
from ops.models import OpsRollup, RollupWidth

ACCEPTANCE_DAYS = 7


def pair_acceptance_chart(targets: list[int] | None = None, days: int = ACCEPTANCE_DAYS) -> str:
    """Hourly acceptance (accepted / drafted) of each (target, draft) pair, from the rollups."""
    since = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(days=days)
    rows = OpsRollup.objects.filter(width=RollupWidth.HOUR, series="pair", start__gte=since).order_by("start")
    if targets is not None:
        rows = [r for r in rows if r.key.split(":")[0] in {str(t) for t in targets}]
    hours = sorted({r.start for r in rows})
    by_key: dict[str, dict] = {}
    for row in rows:
        by_key.setdefault(row.key, {})[row.start] = row
    ids = {int(part) for key in by_key for part in key.split(":") if part.isdigit()}
    names = {v.pk: f"{v.name}:{v.version}" for v in ModelVersion.objects.filter(pk__in=ids)}
    series = []
    for i, (key, slots) in enumerate(sorted(by_key.items())):
        target, _, draft = key.partition(":")
        label = f"{names.get(int(target), target)} + {names.get(int(draft), 'no draft') if draft.isdigit() else 'no draft'}"
        points = [(h.strftime("%m-%d %H:00"), _acceptance(slots.get(h))) for h in hours]
        series.append(Series(label, points, PALETTE[i % len(PALETTE)]))
    return line_chart(series, "%", top=100.0, title=f"Acceptance of each model pair, hourly, last {days} days")


def _acceptance(row: OpsRollup | None) -> float | None:
    values = (row.values or {}) if row is not None else {}
    return 100.0 * values["accepted"] / values["drafted"] if values.get("drafted") else None


ModelVersionAdmin.acceptance_chart = staticmethod(pair_acceptance_chart)
