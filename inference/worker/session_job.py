"""A session as the batching loop holds it (`SessionJob`) and as it leaves the batch (`SessionEnd`).

A task thread prepares a `SessionJob` (lifecycle.prepare), hands it to the loop and waits on
``job.done``. When its row leaves the batch the loop thread computes a `SessionEnd`
(lifecycle.session_end) that holds a snapshot of its recorder, so nothing the writer thread
reads changes under it; the writer thread writes it (lifecycle.write_end) and sets ``job.done``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core import tracing
from inference.worker.recorder import SessionRecorder
from metadata.models import Session

if TYPE_CHECKING:
    from inference.engine.batch.engine import BatchRequest, RowEvent


@dataclass
class SessionJob:
    """A session handed to the loop, and how its task thread learns that it ended."""

    session: Session
    request: BatchRequest
    target: object  # LoadedModel
    draft: object | None
    model_name: str
    recorder: SessionRecorder
    dspark: object | None = None  # the target's DSpark drafter (a DSparkModel), when it has one
    done: threading.Event = field(default_factory=threading.Event)
    status: str = ""
    trace: tracing.SessionTrace | None = None  # its spans, while tracing is on (core.tracing)

    @property
    def fence(self) -> int:
        """The run's fence: the ``attempts`` its claim returned (``sessions.runs.fencing``)."""
        return self.session.attempts

    @property
    def pair(self) -> tuple[int, int | None]:
        return (self.session.target_id, self.session.draft_id)


@dataclass(frozen=True)
class SessionEnd:
    """A session that left the batch, as the loop thread hands it to the writer thread.

    ``failure`` says why its outcome could not be computed; the writer then marks it failed.
    """

    job: SessionJob
    recorder: SessionRecorder  # a snapshot: the loop thread keeps nothing of the session
    status: str
    finish_reason: str
    error: str
    text: str = ""
    stats: dict | None = None
    event: RowEvent | None = None  # its last step's (the engine has let go of its row)
    failure: str = ""
