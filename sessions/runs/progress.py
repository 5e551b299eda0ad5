"""A running session's progress (its token count and text so far), written for many sessions in one UPDATE.

The worker's flush writes it inside its fenced transaction, for the runs that still own their
sessions; their cached states go together after the commit (one reload, one Redis round trip and
one broadcast per region for all, instead of a reload and four round trips per session).
"""
from __future__ import annotations

from collections.abc import Sequence

from metadata.models import Session
from sessions.state import invalidate_sessions

PROGRESS_FIELDS = ("token_count", "text", "updated_at", "last_activity_at")


def write_progress(rows: Sequence[Session]) -> None:
    """Write the ``PROGRESS_FIELDS`` of ``rows`` (sessions by pk, made in code) in one UPDATE."""
    if not rows:
        return
    Session.objects.bulk_update(list(rows), PROGRESS_FIELDS)
    invalidate_sessions(row.pk for row in rows)
