"""What a batch step leaves behind: stream events at once, token and candidate rows in batches.

Every row's step goes to its session's Redis Stream at once (the client sees tokens as they are
verified): the loop hands the events of all rows of a step to its writer thread, which publishes
them in one round trip. Token and candidate rows of every session in the batch go to one shared
`BatchWriter`, flushed when 100 rows of a kind are pending or `SPECOPS_TOKEN_FLUSH_MS` has
passed: one transaction per flush, never a write per row per step. The progress (token_count,
text) of the sessions due one rides in the same transaction, one bulk UPDATE at most every
`SPECOPS_PROGRESS_MS`. The loop thread builds the rows, events and progress rows and `take`s a
flush; the writer thread (write_behind.py) `write`s it, publishes the steps (`publish_step`),
and ends the sessions (lifecycle.write_end).

Fenced (``sessions.runs.fencing``): each flush carries the fence of every session it writes for; the writer
locks those sessions' rows in the flush's transaction and writes only the rows and progress of
the runs that still own them. What a stale run wrote is dropped, and `write` names it, so the
loop drops the run.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from django.db import transaction
from django.utils import timezone

from core import tracing
from inference.conf import conf
from metadata.history import BatchWriter, pg_text, token_records
from metadata.models import Candidate, Session, TokenKind, TokenRecord
from sessions.runs import bound_stall, lock_sessions, owns, ran_last, write_progress
from sessions.streams import token_stream

if TYPE_CHECKING:  # the engine (torch) loads only where sessions run, not where they end
    from inference.engine.batch.engine import RowEvent

def token_kinds(drafted: int, accepted: int, bonus: bool, count: int) -> list[int]:
    """The kind of each emitted token of one step (a stop may have cut the step short)."""
    if drafted == 0:
        return [TokenKind.TARGET] * count
    last = TokenKind.BONUS if bonus else TokenKind.CORRECTION
    return [TokenKind.ACCEPTED if offset < accepted else last for offset in range(count)]


@dataclass
class SessionRecorder:
    """One session's running output: its tokens, stream steps and timings."""

    session: Session
    decode: object
    token_ids: list[int] = field(default_factory=list)
    step: int = 0
    admitted_at: float | None = None
    step_times: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    dirty: bool = False
    progress_saved_at: float = float("-inf")  # time.monotonic() of the last progress write
    # the most sessions that shared a step with this one
    batch_rows_max: int = 0

    def record(self, event: RowEvent, writer: BatchWriter) -> token_stream.StreamEvent | None:
        """Queue the step's rows and return its stream event, which the caller publishes with the
        other rows' (token_stream.publish_many); a step with no token (prefill) records nothing."""
        step = event.step
        if not step.token_ids and not step.branches:
            return None
        start = len(self.token_ids)
        self.token_ids.extend(step.token_ids)
        kinds = token_kinds(step.drafted, step.accepted, event.bonus, len(step.token_ids))
        for row in token_records(self.session, start, self.step, step.token_ids, kinds, self.decode):
            writer.add(row)
        for branch_no, branch in enumerate(step.branches):
            writer.add(Candidate(
                session_id=self.session.pk, session_created_at=self.session.created_at,
                step=self.step, branch=branch_no, token_ids=list(branch.token_ids),
                score=float(branch.score), accepted_len=branch.accepted_len,
            ))
        stream_event = token_stream.StreamEvent(self.session.pk, "tokens", {
            "step": self.step, "token_ids": list(step.token_ids),
            "text": self.decode(list(step.token_ids)),
            "kinds": [int(kind) for kind in kinds],
        }, step=self.step, fence=self.fence)
        self.step_times.append(time.time())
        self.step_tokens.append(len(step.token_ids))
        self.step += 1
        self.dirty = True
        return stream_event

    @property
    def fence(self) -> int:
        """The fence of this run: the ``attempts`` its claim returned (``sessions.runs.claim_session``)."""
        return self.session.attempts

    def progress_row(self, now) -> Session:
        """The session's progress fields as a row for one bulk UPDATE (see BatchRecorder.write)."""
        self.dirty = False
        self.progress_saved_at = time.monotonic()
        return Session(pk=self.session.pk, token_count=len(self.token_ids),
                       text=pg_text(self.decode(self.token_ids)), updated_at=now, last_activity_at=now)

    def progress_due(self, every_s: float) -> bool:
        return self.dirty and time.monotonic() - self.progress_saved_at >= every_s

    def snapshot(self) -> SessionRecorder:
        """A copy that shares no list with this one (a session's end, for the writer thread)."""
        return replace(self, token_ids=list(self.token_ids), step_times=list(self.step_times),
                       step_tokens=list(self.step_tokens))


@dataclass(frozen=True)
class PendingFlush:
    """One flush as the loop thread hands it to the writer thread: rows it no longer holds, and
    the progress rows of the sessions due one."""

    rows: dict[type, list]
    progress: tuple[Session, ...] = ()
    fences: dict[Hashable, int] = field(default_factory=dict)  # session id -> its run's fence

    def __len__(self) -> int:
        return sum(len(rows) for rows in self.rows.values())

    def runs(self) -> set[tuple[Hashable, int]]:
        """(session id, fence) of every session this flush writes for (unknown fence: -1, never owned)."""
        ids = {row.session_id for rows in self.rows.values() for row in rows} | {row.pk for row in self.progress}
        return {(pk, self.fences.get(pk, -1)) for pk in ids}

    def fenced(self, current: dict[Hashable, tuple]) -> PendingFlush:
        """The part of this flush its runs may still write, by the sessions' ``current`` state
        (fencing.lock_sessions): rows while the run `ran_last`, progress while it `owns`."""
        def allowed(pk, rule) -> bool:
            return pk in current and rule(*current[pk], self.fences.get(pk, -1))

        return PendingFlush({model: [row for row in rows if allowed(row.session_id, ran_last)]
                             for model, rows in self.rows.items()},
                            tuple(row for row in self.progress if allowed(row.pk, owns)), self.fences)


class BatchRecorder:
    """The rows of every session of one batching loop: their flush schedule and their writes.

    Each thread has its own half: the loop thread adds rows to ``writer`` and `take`s them when a
    flush is due; the writer thread `write`s what was taken through a BatchWriter of its own,
    which keeps the rows of a flush that failed for the next one.
    """

    def __init__(self) -> None:
        self.writer = BatchWriter((TokenRecord, Candidate))  # the loop thread's
        self._unwritten: list[PendingFlush] = []  # the writer thread's: flushes to write (again)
        self.flush_every_s = conf.TOKEN_FLUSH_MS / 1000
        self.progress_every_s = max(conf.PROGRESS_MS, conf.TOKEN_FLUSH_MS) / 1000
        self._last_flush = time.monotonic()

    def due(self) -> bool:
        return self.writer.full or (len(self.writer) and
                                    time.monotonic() - self._last_flush >= self.flush_every_s)

    def take(self, recorders: list[SessionRecorder]) -> PendingFlush:
        """Loop thread: the pending rows and the progress of the sessions due one, for `write`."""
        now = timezone.now()
        progress = tuple(recorder.progress_row(now) for recorder in recorders
                         if recorder.progress_due(self.progress_every_s))
        self._last_flush = time.monotonic()
        return PendingFlush(self.writer.take(), progress, {recorder.session.pk: recorder.fence for recorder in recorders})

    def discard(self, session_id: Hashable) -> None:
        """Loop thread: forget the pending rows of a session whose run was dropped (stale)."""
        for rows in self.writer.pending.values():
            rows[:] = [row for row in rows if row.session_id != session_id]

    def write(self, pending: PendingFlush) -> set[tuple[Hashable, int]]:
        """Writer thread: write the flush's rows (after any a failed one left) and its progress,
        in one transaction, for the runs that still own their sessions; return the (session id,
        fence) of the runs refused (stale: their rows and progress are dropped).

        Progress (token_count, text) of a running session is written at most every
        SPECOPS_PROGRESS_MS, in one UPDATE for all of them; their cache invalidations go together
        after the commit (one LSN read, one reload and one Redis round trip per region for all).
        Per session and per flush this had cost an UPDATE, an LSN read and the cache's Redis
        round trips: measured, 73 % of the batching loop's time at 8 rows, against 16 % in the
        engine's step. The token rows, which streams and resumption
        read, are written at every flush as before.
        """
        self._unwritten.append(pending)
        flushes = self._unwritten
        runs = set().union(*(flush.runs() for flush in flushes))
        if not runs:
            self._unwritten = []
            return set()
        with transaction.atomic():
            current = self._write_fenced(flushes, runs)
        self._unwritten = []  # committed (a failure above keeps them all for the next flush)
        return {(pk, fence) for pk, fence in runs if pk not in current or not ran_last(*current[pk], fence)}

    def _write_fenced(self, flushes: list[PendingFlush], runs: set[tuple[Hashable, int]]) -> dict:
        """Inside the flush's transaction: the rows first, then the sessions' locks and the check
        (so a lease renewal is not held up behind rows that wait on PostgreSQL); when a run turns
        out stale, back to before the rows and write only those of the runs that may."""
        bound_stall()  # the rows' locks too
        savepoint = transaction.savepoint()
        self._insert(flushes, None)
        current = lock_sessions(runs)
        if any(pk not in current or not ran_last(*current[pk], fence) for pk, fence in runs):
            transaction.savepoint_rollback(savepoint)  # its locks went with it
            current = lock_sessions(runs)
            self._insert(flushes, current)
        else:
            transaction.savepoint_commit(savepoint)
        progress: dict[Hashable, Session] = {}  # a later flush's progress replaces an earlier's
        for flush in flushes:
            progress.update((row.pk, row) for row in flush.fenced(current).progress)
        write_progress(list(progress.values()))  # their cached states together: one reload, one round trip
        return current

    @staticmethod
    def _insert(flushes: list[PendingFlush], current: dict | None) -> None:
        """The flushes' token and candidate rows (with ``current``, only those fencing allows)."""
        writer = BatchWriter((TokenRecord, Candidate))
        for flush in flushes:
            writer.extend((flush if current is None else flush.fenced(current)).rows)
        writer.flush()


def publish_step(events: list[token_stream.StreamEvent], traces: list[tracing.SessionTrace | None]) -> None:
    """Writer thread: a step's stream events, every row's, in one round trip."""
    # One session's publish hangs under its trace; a shared one under none.
    with tracing.activated(traces[0]) if len(traces) == 1 else tracing.untraced():
        token_stream.publish_many(events)
