"""The device's batching loop: one thread per worker process runs every session it holds together.

Celery delivers sessions on the device queue to a threads pool of `SPECOPS_MAX_BATCH` threads
(each message acknowledged late, so a crash redelivers it). Each task thread prepares its
session and hands it to this loop, then waits for it to end; the loop thread owns the models'
forwards, so every session in hand joins the running batch at the next step boundary. One
engine per (target, draft) pair; the loop steps each engine that has work in turn.

The loop also enforces what Celery's threads pool cannot: per-session deadlines (finish
reason "timeout") and cancellation (a session whose row an operator or client set to
"cancelled" leaves the batch at the next step).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import close_old_connections
from django.utils import timezone

from inference.conf import conf
from inference.engine.batch import BatchedSpeculativeEngine, BatchRequest, RowEvent
from inference.engine.policy import SpeculationPolicy
from inference.worker import metrics
from inference.worker.recording import BatchRecorder, SessionRecorder, finish_session
from metadata.models import Session, SessionStatus
from metadata.sessions import token_stream
from specops import tracing
from specops.ops import latency_budget

logger = logging.getLogger(__name__)

CANCEL_POLL_S = 0.25  # a cancel lands within this (an indexed query on the running ids)
IDLE_WAIT_S = 0.5


@dataclass
class SessionJob:
    """A session handed to the loop, and how its task thread learns that it ended."""

    session: Session
    request: BatchRequest
    target: object  # LoadedModel
    draft: object | None
    model_name: str
    recorder: SessionRecorder
    done: threading.Event = field(default_factory=threading.Event)
    status: str = ""
    trace: tracing.SessionTrace | None = None  # its spans, while tracing is on (specops.tracing)

    @property
    def pair(self) -> tuple[int, int | None]:
        return (self.session.target_id, self.session.draft_id)


def status_of(finish_reason: str) -> str:
    if finish_reason == "cancelled":
        return SessionStatus.CANCELLED
    if finish_reason in ("error", "timeout"):
        return SessionStatus.FAILED
    return SessionStatus.SUCCEEDED


class DeviceBatchLoop:
    """Holds the engines of one device and the sessions they run."""

    def __init__(self, max_rows: int, prefill_chunk: int, policy_enabled: bool) -> None:
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.policy_enabled = policy_enabled
        self.inbox: queue.Queue[SessionJob] = queue.Queue()
        self.engines: dict[tuple[int, int | None], BatchedSpeculativeEngine] = {}
        self.jobs: dict[Hashable, SessionJob] = {}
        self.recorder: BatchRecorder | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last_cancel_poll = 0.0
        self._last_renewal = 0.0

    # -- called from task threads -------------------------------------------------------

    def submit(self, job: SessionJob) -> None:
        """Hand a prepared session to the loop (starting the loop thread on first use)."""
        job.trace = tracing.session_trace(job.session.pk, job.session.enqueued_at)  # the task's span is current
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="specops-batching-loop",
                                                daemon=True)
                self._thread.start()
        self.inbox.put(job)

    # -- the loop thread ----------------------------------------------------------------

    def _run(self) -> None:
        self.recorder = BatchRecorder()
        while True:
            try:
                self._admit(block=not self.jobs)
                if not self.jobs:
                    continue
                with tracing.untraced():  # housekeeping of every session: in no session's trace
                    self._poll_cancellations()
                    self._renew_leases()
                for pair, engine in list(self.engines.items()):
                    if engine.has_work():
                        self._step(pair, engine)
                if self.recorder.due():
                    self._flush()
            except Exception:  # the loop must outlive any one failure; the job paths report it
                logger.exception("batching loop iteration failed")
                close_old_connections()
                time.sleep(0.1)

    def _engine(self, job: SessionJob) -> BatchedSpeculativeEngine:
        engine = self.engines.get(job.pair)
        if engine is None:
            # LoadedModels: the engine checks that the pair shares a tokenizer and EOS
            engine = BatchedSpeculativeEngine(
                job.target, job.draft, decode=job.target.tokenizer.decode,
                policy=SpeculationPolicy(enabled=self.policy_enabled),
                max_rows=self.max_rows, prefill_chunk=self.prefill_chunk or None,
                prefill=None if conf.PREFILL == "auto" else conf.PREFILL)
            self.engines[job.pair] = engine
        return engine

    def _admit(self, block: bool) -> None:
        """Take every job waiting in the inbox (block a little when there is nothing to do)."""
        try:
            job = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                self._engine(job).submit(job.request)
                self.jobs[job.request.request_id] = job
                job.recorder.admitted_at = time.time()  # joins the batch at the next step boundary
            except Exception as error:  # settings the engine refuses end this session only
                self._end(job, "error", f"{type(error).__name__}: {error}", None)
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _poll_cancellations(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_poll < CANCEL_POLL_S:
            return
        self._last_cancel_poll = now
        cancelled = Session.objects.filter(pk__in=list(self.jobs), status=SessionStatus.CANCELLED)
        for session_id in cancelled.values_list("pk", flat=True):
            job = self.jobs.get(session_id)
            if job is not None:
                self.engines[job.pair].cancel(session_id)

    def _renew_leases(self) -> None:
        """Heartbeat: extend the lease of every session in hand, so the reconciler leaves them be."""
        now = time.monotonic()
        if now - self._last_renewal < conf.SESSION_LEASE_S / 3:
            return
        self._last_renewal = now
        wall = timezone.now()
        Session.objects.filter(pk__in=list(self.jobs), status=SessionStatus.RUNNING).update(
            lease_expires_at=wall + timedelta(seconds=conf.SESSION_LEASE_S), last_activity_at=wall)

    def _step(self, pair, engine: BatchedSpeculativeEngine) -> None:
        try:
            events = engine.step()
        except Exception as error:  # a failed forward fails every session of this engine
            logger.exception("batch step failed; failing its %d sessions", engine.active)
            self.engines.pop(pair, None)
            for job in [j for j in self.jobs.values() if j.pair == pair]:
                self._end(job, "error", f"{type(error).__name__}: {error}", None)
            return
        for kind, rows, tokens, seconds in engine.forward_log:
            metrics.observe_forward(kind, rows, tokens, seconds)
        engine.forward_log.clear()
        if engine.last_decision is not None:
            running = sum(len(other.rows) for other in self.engines.values())
            metrics.observe_policy_decision(engine.last_decision.depth, running)
        if tracing.enabled():
            self._trace_step(engine, events)
        self._record(events)

    def _record(self, events: list[RowEvent]) -> None:
        """Queue the step's rows, stream every row's step in one round trip, then end the rows
        that finished (a session's ``done`` follows its last ``tokens`` event)."""
        stream_events, traces, finished = [], [], []
        for event in events:
            job = self.jobs.get(event.request_id)
            if job is None:
                continue
            recorder = job.recorder
            recorder.batch_rows_max = max(recorder.batch_rows_max, len(events))
            if recorder.admitted_at is None:
                recorder.admitted_at = time.time()
            stream_event = recorder.record(event, self.recorder.writer)
            if stream_event is not None:
                stream_events.append(stream_event)
                traces.append(job.trace)
            if event.finished:
                finished.append((job, event))
        # One session's publish hangs under its trace; a shared one under none.
        with tracing.activated(traces[0]) if len(traces) == 1 else tracing.untraced():
            token_stream.publish_many(stream_events)
        for job, event in finished:
            with tracing.activated(job.trace):
                self._end(job, event.step.finish_reason, event.error, event)

    def _trace_step(self, engine: BatchedSpeculativeEngine, events: list[RowEvent]) -> None:
        """Each session's copy of the step's spans, with the engine's measured times (specops.tracing)."""
        timing = engine.last_step_timing
        if timing is None:
            return
        lane_end = timing.started_ns + int(timing.prefill_seconds * 1e9)  # separate prefill's forwards
        draft_end = lane_end + int(timing.draft_seconds * 1e9)
        verify_end = draft_end + int(timing.verify_seconds * 1e9)
        # a prompt chunk ran in the prefill lane (separate mode) or in the verify forward (shared)
        prefill_span = (timing.started_ns, lane_end) if timing.prefill_seconds else (draft_end, verify_end)
        shared = {"specops.engine.step": timing.step, "specops.batch.rows": timing.rows}
        for event in events:
            job = self.jobs.get(event.request_id)
            if job is None or job.trace is None:
                continue
            if event.step.drafted:
                job.trace.child("specops.draft", lane_end, draft_end, **shared,
                                **{"specops.draft.nodes": event.step.drafted, "specops.drafter": event.drafter})
            if event.prefill_tokens:
                job.trace.child("specops.prefill", *prefill_span, **shared,
                                **{"specops.prefill.tokens": event.prefill_tokens})
            if event.step.token_ids:
                job.trace.child("specops.verify", draft_end, verify_end, **shared,
                                **{"specops.accepted": event.step.accepted,
                                   "specops.tokens": len(event.step.token_ids)})

    def _flush(self) -> None:
        jobs = self.jobs.values()
        with tracing.batch_write([job.trace for job in jobs if job.recorder.dirty], len(self.recorder.writer)):
            self.recorder.flush([job.recorder for job in jobs])

    def _end(self, job: SessionJob, finish_reason: str, error: str, event: RowEvent | None) -> None:
        """Commit the session's rows, write its outcome, record metrics, wake its task thread."""
        status = status_of(finish_reason)
        recorder = job.recorder
        stats = None
        try:
            self._flush()
            if event is not None:
                stats = event.stats.to_dict()
                created = job.session.created_at.timestamp()
                gaps = metrics.inter_token_gaps(recorder.step_times, recorder.step_tokens)
                stats.update(
                    ttft_seconds=recorder.step_times[0] - created if recorder.step_times else None,
                    queue_seconds=recorder.admitted_at - created if recorder.admitted_at else None,
                    itl_seconds=sum(gaps) / len(gaps) if gaps else None)
                stats.update(drafter=event.drafter, batch_rows_max=recorder.batch_rows_max,
                             depth_choices={str(k): v for k, v in sorted(event.depth_choices.items())})
                if finish_reason == "timeout":
                    error = error or f"generation exceeded {conf.GENERATION_TIMEOUT_S:g} s"
            decode = job.target.tokenizer.decode
            text = decode(recorder.token_ids)
            finish_session(job.session, status, error=error, finish_reason=finish_reason,
                           token_ids=recorder.token_ids, text=text, stats=stats,
                           next_step=recorder.step)
            if status == SessionStatus.SUCCEEDED:
                from inference import prediction_cache

                prediction_cache.remember_result(job.session, text=text,
                                                 token_count=len(recorder.token_ids),
                                                 finish_reason=finish_reason, stats=stats or {})
        except Exception as failure:
            logger.exception("recording the end of session %s failed", job.session.pk)
            status = SessionStatus.FAILED
            try:  # still end it (its committed rows stay), so no client waits for a done event
                finish_session(job.session, status, finish_reason=finish_reason,
                               error=f"recording the outcome failed: {type(failure).__name__}: {failure}",
                               next_step=recorder.step)
            except Exception:
                logger.exception("session %s could not be marked failed", job.session.pk)
        finally:
            self._observe(job, status, event)
            self.jobs.pop(job.request.request_id, None)
            if job.trace is not None:
                job.trace.end(status)
            job.status = status
            job.done.set()

    def _observe(self, job: SessionJob, status: str, event: RowEvent | None) -> None:
        recorder = job.recorder
        drafter = event.drafter if event is not None and event.drafter else job.request.drafter
        # from the session's creation: what the client waits, the broker's queue included
        now = time.time()
        created = job.session.created_at.timestamp()
        ttft = recorder.step_times[0] - created if recorder.step_times else None
        queue_seconds = (recorder.admitted_at - created) if recorder.admitted_at else None
        metrics.observe_request(
            job.model_name, drafter, status, queue_seconds=queue_seconds, ttft_seconds=ttft,
            inter_token_seconds=metrics.inter_token_gaps(recorder.step_times, recorder.step_tokens),
            e2e_seconds=now - created, new_tokens=len(recorder.token_ids))
        if recorder.step_times and recorder.admitted_at:  # the latency budget's "inference"
            latency_budget.observe("inference", max(0.0, recorder.step_times[0] - recorder.admitted_at))
        if event is not None:
            stats = event.stats
            drafts = stats.drafted_per_position[0] if stats.drafted_per_position else 0
            metrics.observe_speculation(drafter, stats.drafted_per_position,
                                        stats.accepted_per_position, drafts)


_loop: DeviceBatchLoop | None = None
_loop_lock = threading.Lock()


def device_loop() -> DeviceBatchLoop:
    """This process's loop (one per worker process, so one per device)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = DeviceBatchLoop(conf.MAX_BATCH, conf.PREFILL_CHUNK, conf.SPECULATION_POLICY)
        return _loop
