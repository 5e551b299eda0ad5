"""What the admin shows of maintenance runs: the recent ones, as rows for the page and its poll."""
from __future__ import annotations

from django.db import DEFAULT_DB_ALIAS

from metadata.maintenance.requests import ACTIVE
from metadata.models import MaintenanceRun

RECENT_RUNS = 20


def recent_runs(limit: int = RECENT_RUNS) -> list[MaintenanceRun]:
    """The latest runs, newest first, from the primary (progress is written there as it happens)."""
    runs = MaintenanceRun.objects.using(DEFAULT_DB_ALIAS).select_related("requested_by").order_by("-requested_at", "-pk")
    return list(runs[:limit])


def _moment(value) -> str | None:
    return value.isoformat() if value else None


def run_as_dict(run: MaintenanceRun) -> dict:
    """One run for the page's poll (JSON): who, when, what, how far, and how it ended."""
    return {
        "id": run.pk,
        "action": run.action,
        "action_label": run.get_action_display(),
        "target": run.target,
        "requested_by": run.requested_by.get_username() if run.requested_by else None,
        "requested_at": _moment(run.requested_at),
        "started_at": _moment(run.started_at),
        "finished_at": _moment(run.finished_at),
        "status": run.status,
        "active": run.status in ACTIVE,
        "progress": {"done": run.progress_done, "total": run.progress_total, "line": run.progress_line},
        "summary": run.outcome.get("summary", "") if isinstance(run.outcome, dict) else "",
        "outcome": run.outcome,
        "error": run.error,
    }
