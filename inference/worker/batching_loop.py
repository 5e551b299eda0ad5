"""The device's batching loop: one thread per worker process runs every session it holds together.

Celery delivers sessions on the device queue to a threads pool of ``SPECOPS_WORKER_THREADS``
threads, twice ``SPECOPS_MAX_BATCH`` by default and shared across tenants (claim_share.py; each
message acknowledged late, so a crash redelivers it). Each task thread prepares its
session and hands it to this loop, then waits for it to end; every session in hand joins the
running batch at the next step boundary. One engine per (target, draft) pair.

Where the engines run (``SPECOPS_ENGINE_CORE``): by default in the device's engine core, a child
process that holds the models and only steps (inference/engine_core/); this loop feeds it and
drains its step reports, so the front's database and Redis work never competes with a forward
for the GIL. With ``thread`` the loop steps the engines itself (`LocalEngines`). Either way the
loop sees one interface (`host`): submit, cancel, step, drop. A core that dies is restarted and
every session in hand is submitted again from the tokens it already has.

The loop also enforces what Celery's threads pool cannot: per-session deadlines (finish
reason "timeout") and cancellation (a session whose row an operator or client set to
"cancelled" leaves the batch at the next step).

The loop thread records; what a step leaves behind (stream events, row flushes, sessions' ends)
is published and written off it, in the order the loop hands it over (batch_output.py).
Cancellation polls and lease renewals (``sessions.runs.renew_leases``) stay on the loop thread.

Fencing (``sessions.runs.fencing``): a run whose fence turns out stale (a renewal or a flush refused: another
run took its session over while this process was paused) leaves the batch at the next step
boundary with no final write, and its task thread is woken with status ``superseded``. A second
row for a session the loop already runs is a later claim: the older row leaves, and the newer
joins once the engine has let the older go (the engine knows rows by session id).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Hashable
from dataclasses import replace

from django.db import close_old_connections

from core import tracing
from inference.conf import conf
from inference.engine.batch.engine import RowEvent
from inference.engine.drafters.suffix import suffix_corpora
from inference.engine_core.client import CoreClient, CoreRestarted, RemoteCorpora
from inference.engine_core.engines import LocalEngines
from inference.engine_core.protocol import EngineSettings, Refused, StepReport
from inference import affinity
from inference.worker import compile_reading, metrics, prefix_cache_reading, suffix_feed
from inference.worker.batch_output import BatchOutput
from inference.worker.lifecycle import session_end
from inference.worker.residency import residency
from inference.worker.recorder import BatchRecorder
from inference.worker.session_job import SessionEnd, SessionJob
from inference.worker.write_behind import MAX_ITEMS, WriteBehind
from metadata.models import Session, SessionStatus
from sessions.runs import SUPERSEDED, renew_leases

logger = logging.getLogger(__name__)

CANCEL_POLL_S = 0.25  # a cancel lands within this (an indexed query on the running ids)
IDLE_WAIT_S = 0.5
RETIRED_CHECK_S = 30.0  # how often idle engines are checked for a target no longer active
OVERHEAD_LOG_S = 10.0  # how often a busy loop logs its front's time per step against the engine's


class DeviceBatchLoop:
    """Holds the engines of one device and the sessions they run."""

    def __init__(self, max_rows: int, prefill_chunk: int, policy_enabled: bool,
                 write_queue: int = MAX_ITEMS, core: bool = False) -> None:
        """``core``: run the engines in an engine-core process (else in this loop's thread)."""
        self.settings = EngineSettings(
            max_rows=max_rows, prefill_chunk=prefill_chunk, policy_enabled=policy_enabled,
            prefill_mode=None if conf.PREFILL == "auto" else conf.PREFILL, pack_linear=conf.PACK_LINEAR,
            onednn_linear=conf.ONEDNN_LINEAR, resident_models=conf.RESIDENT_MODELS,
            prefix_cache_mb=conf.PREFIX_CACHE_MB, prefix_cache_block=conf.PREFIX_CACHE_BLOCK,
            compile=conf.ENGINE_COMPILE, compile_dir=str(conf.COMPILE_DIR), kv_cache_mb=conf.KV_CACHE_MB,
            compile_background=conf.COMPILE_BACKGROUND)
        self.inbox: queue.Queue[SessionJob] = queue.Queue()
        self.jobs: dict[Hashable, SessionJob] = {}  # the loop thread's only
        self.recorder = BatchRecorder()
        # fencing: runs the writer found stale, (session id, fence), for the loop thread to drop
        self._stale: queue.SimpleQueue[set[tuple[Hashable, int]]] = queue.SimpleQueue()
        self.output = BatchOutput(self.recorder, self._stale, write_queue, while_blocked=self._renew_leases_untraced)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last_cancel_poll = 0.0
        self._last_renewal = 0.0
        self._leaving: dict[Hashable, tuple[int, int | None]] = {}  # dropped rows the engine still holds
        self._deferred: list[SessionJob] = []  # newer runs waiting for their older row to leave
        self._last_retired_check = time.monotonic()
        self._overhead = [0, 0.0, 0.0]  # step reports, engine seconds, front seconds
        self._last_overhead_log = time.monotonic()
        self.host: LocalEngines | CoreClient = (  # last: a core's start renews the leases in hand
            CoreClient(self.settings, while_waiting=self._renew_leases_untraced) if core
            else LocalEngines(self.settings, residency))

    @property
    def writes(self) -> WriteBehind:
        """The writer's queue (the row flushes and, after each, its sessions' ends)."""
        return self.output.writes

    @property
    def engines(self) -> dict:
        """The engines this loop steps itself (thread mode; a core holds its own)."""
        return self.host.engines if isinstance(self.host, LocalEngines) else {}

    @engines.setter
    def engines(self, engines: dict) -> None:
        self.host.engines = engines

    # -- called from task threads -------------------------------------------------------

    def submit(self, job: SessionJob) -> None:
        """Hand a prepared session to the loop (starting the loop thread on first use). The
        engine shares its rows fairly across tenants (SPECOPS_FAIR_ADMISSION, SPECOPS_PREEMPTION)."""
        job.request = replace(job.request, fair_group=job.session.tenant_id if conf.FAIR_ADMISSION else None,
                              preemptible=conf.PREEMPTION)
        job.trace = tracing.session_trace(job.session.pk, job.session.enqueued_at)  # the task's span is current
        self._ensure_running()
        self.inbox.put(job)

    def _ensure_running(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="specops-batching-loop",
                                                daemon=True)
                self._thread.start()

    @property
    def corpora(self):
        """Where the suffix drafter's corpora are fed: the core's, or this process's own."""
        if isinstance(self.host, CoreClient):
            return RemoteCorpora(self.host, suffix_corpora.max_corpora)
        return suffix_corpora

    def preload(self, models: list) -> None:
        """Load these models where the engines run (thread mode: the residency already holds them)."""
        if isinstance(self.host, CoreClient):
            self.host.preload([model.spec for model in models])

    def replay(self, target, prompt_ids: list[int], config) -> list[int]:
        """The target's own greedy tokens, where the engines run (the losslessness canary)."""
        self._ensure_running()  # the loop thread delivers a core's answer
        return self.host.replay(target, prompt_ids, config)

    # -- the loop thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._run_once()
            except Exception:  # the loop must outlive any one failure; the job paths report it
                logger.exception("batching loop iteration failed")
                close_old_connections()
                time.sleep(0.1)

    def _run_once(self) -> None:
        """Admit the newcomers, then one step of every engine with work; flush when due."""
        self._admit(block=not self.jobs and not self._leaving)
        # each iteration (idle ones too, so the gauge drains with the writer)
        metrics.observe_writer_backlog(self.writes.waiting, self.writes.max_items)
        affinity.heartbeat(len(self.jobs), self.settings.max_rows)  # routing may send this node more (throttled)
        while not self._stale.empty():
            self._drop_stale(self._stale.get())
        busy = bool(self.jobs or self._leaving)
        if busy:
            with tracing.untraced():  # housekeeping of every session: in no session's trace
                self._poll_cancellations()
                self._renew_leases()
        for report in self.host.step(wait=busy):
            started = time.perf_counter()
            self._take(report)
            if isinstance(report, StepReport) and not report.failure and not report.early:
                self._observe_overhead(report.seconds, time.perf_counter() - started)
        if not busy:
            return
        if time.monotonic() - self._last_retired_check >= RETIRED_CHECK_S:
            self.drop_retired_engines()
        if self.recorder.due():
            self._flush()

    def drop_retired_engines(self) -> list[tuple[int, int | None]]:
        """Drop the idle engines whose target is no longer active (promoted away, retired), and
        their models from this process: a promotion otherwise left every old pair's engine and
        weights in memory for good (a GPU filled after a few promotions). An engine with rows,
        or a session of its pair still in the loop, stays until they end. Returns the pairs dropped."""
        self._last_retired_check = time.monotonic()
        idle = [pair for pair in self.host.idle_pairs()
                if not any(job.pair == pair for job in self.jobs.values()) and pair not in self._leaving.values()]
        if not idle:
            return []
        from inference.models import ModelVersion, VersionStatus

        active = set(ModelVersion.objects.filter(pk__in={pair[0] for pair in idle}, status=VersionStatus.ACTIVE)
                     .values_list("pk", flat=True))
        dropped = self.host.drop([pair for pair in idle if pair[0] not in active], keep=active)
        if dropped:
            logger.info("dropped the engines of retired pairs %s and freed their models", dropped)
        return dropped

    def _admit(self, block: bool) -> None:
        """Take every job waiting in the inbox (block a little when there is nothing to do)."""
        deferred, self._deferred = self._deferred, []
        for job in deferred:
            self._admit_one(job)
        try:
            job = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._admit_one(job)
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _admit_one(self, job: SessionJob) -> None:
        """Admit a job; of two runs of one session, the older (lower fence) leaves."""
        session_id = job.request.request_id
        current = self.jobs.get(session_id)
        if current is not None:
            if current.fence >= job.fence:
                self._retire(job)
                return
            self._drop(current)
        if session_id in self._leaving:
            self._deferred.append(job)  # the engine still holds the older row until its next step
            return
        try:
            self.host.submit(job.pair, job.request, job.target, job.draft, job.dspark)
            self.jobs[session_id] = job
            job.recorder.admitted_at = time.time()  # joins the batch at the next step boundary
        except Exception as error:  # settings the engine refuses end this session only
            self._end([(job, "error", f"{type(error).__name__}: {error}", None)])

    def _drop_stale(self, runs: set[tuple[Hashable, int]]) -> None:
        """Drop the runs the database refused, unless a newer run of the session replaced them."""
        for session_id, fence in runs:
            job = self.jobs.get(session_id)
            if job is not None and job.fence == fence:
                self._drop(job)

    def _drop(self, job: SessionJob) -> None:
        """A stale run leaves the batch at the next step, with no final write of its own."""
        session_id = job.request.request_id
        logger.warning("session %s: run %d is stale (a later run took it over); it leaves the batch",
                       session_id, job.fence)
        self.jobs.pop(session_id, None)
        self.recorder.discard(session_id)
        self.host.cancel(session_id)
        self._leaving[session_id] = job.pair
        self._retire(job)

    def _retire(self, job: SessionJob) -> None:
        metrics.SUPERSEDED_RUNS.inc()
        if job.trace is not None:
            job.trace.end(SUPERSEDED)
        job.status = SUPERSEDED
        job.done.set()

    def _poll_cancellations(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_poll < CANCEL_POLL_S:
            return
        self._last_cancel_poll = now
        cancelled = Session.objects.filter(pk__in=list(self.jobs), status=SessionStatus.CANCELLED)
        for session_id in cancelled.values_list("pk", flat=True):
            if session_id in self.jobs:
                self.host.cancel(session_id)

    def _renew_leases_untraced(self) -> None:
        """Lease renewal from inside a step (the loop waiting for room in the writer's queue)."""
        with tracing.untraced():
            self._renew_leases()

    def _renew_leases(self) -> None:
        """Heartbeat: extend the lease of every session in hand, so the reconciler leaves them be;
        the runs whose fence is stale leave (from inside a step: at the next iteration)."""
        now = time.monotonic()
        if now - self._last_renewal < conf.SESSION_LEASE_S / 3:
            return
        self._last_renewal = now
        runs = {session_id: job.fence for session_id, job in list(self.jobs.items())}
        stale = renew_leases(runs)
        if stale:
            self._stale.put({(session_id, runs[session_id]) for session_id in stale})

    def _take(self, report: StepReport | Refused | CoreRestarted) -> None:
        """What the engines did: a step's events, a refused submit, or a core that was restarted."""
        if isinstance(report, CoreRestarted):
            self._resubmit_all()
            return
        if isinstance(report, Refused):
            job = self.jobs.get(report.request_id)
            if job is not None and job.pair == report.pair:
                self._end([(job, "error", report.error, None)])
            return
        pair = report.pair
        if report.failure:  # a failed forward fails every session of this engine
            self._leaving = {key: value for key, value in self._leaving.items() if value != pair}
            self._end([(job, "error", report.failure, None) for job in self.jobs.values() if job.pair == pair])
            return
        for kind, rows, tokens, seconds in report.forward_log:
            metrics.observe_forward(kind, rows, tokens, seconds)
        if report.decision_depth is not None:
            metrics.observe_policy_decision(report.decision_depth, report.running)
        if report.step_costs is not None:
            metrics.observe_step_costs(report.step_costs)
        if report.prefix_cache is not None:
            metrics.observe_prefix_cache(report.prefix_cache)
            prefix_cache_reading.publish(report.prefix_cache)
        if report.runners:
            metrics.observe_runners(pair, report.runners)
            compile_reading.publish(pair, report.runners)
        if tracing.enabled():
            self._trace_step(report)
        self._record(report.events)

    def _observe_overhead(self, step_seconds: float, front_seconds: float) -> None:
        """The front's time per step report against the engine's step time (metrics, and a log line
        every OVERHEAD_LOG_S while busy: bench/serving.py reads it)."""
        metrics.STEP_SECONDS.observe(step_seconds)
        metrics.FRONT_REPORT_SECONDS.observe(front_seconds)
        totals = self._overhead
        totals[0] += 1
        totals[1] += step_seconds
        totals[2] += front_seconds
        if time.monotonic() - self._last_overhead_log >= OVERHEAD_LOG_S:
            self._last_overhead_log = time.monotonic()
            logger.info("batching loop: %d step reports, engine %.2f ms per step, front %.2f ms per report, "
                        "stream events published at most %.0f ms after their step, writes waiting %d, "
                        "sessions held %d", totals[0], totals[1] / totals[0] * 1000, totals[2] / totals[0] * 1000,
                        self.output.take_publish_delay_max() * 1000, self.writes.waiting, len(self.jobs))

    def _resubmit_all(self) -> None:
        """A new core holds none of the rows: every session in hand joins it again, resuming from
        the tokens it already has (streamed ones included, so its stream goes on where it stopped)."""
        self._leaving.clear()
        metrics.ENGINE_CORE_RESTARTS.inc()
        logger.warning("engine core restarted: resubmitting %d session(s)", len(self.jobs))
        for session_id, job in list(self.jobs.items()):
            job.request = replace(job.request, resume_ids=tuple(job.recorder.token_ids))
            try:
                self.host.submit(job.pair, job.request, job.target, job.draft, job.dspark)
            except Exception as error:
                self.jobs.pop(session_id, None)
                self._end([(job, "error", f"{type(error).__name__}: {error}", None)])

    def _record(self, events: list[RowEvent]) -> None:
        """Queue the step's rows, hand the writer every row's stream event (one round trip), then
        end the rows that finished (the writer publishes a session's ``done`` after its last
        ``tokens`` event)."""
        stream_events, traces, finished = [], [], []
        for event in events:
            if event.request_id in self._leaving:  # a dropped run's row: its last event is its leaving
                if event.finished:
                    del self._leaving[event.request_id]
                continue
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
                if event.stats.preemptions:
                    metrics.BATCH_PREEMPTIONS.inc(event.stats.preemptions)
        if stream_events:
            self.output.publish(stream_events, traces)
        if finished:
            self._end([(job, event.step.finish_reason, event.error, event) for job, event in finished])

    def _trace_step(self, report: StepReport) -> None:
        """Each session's copy of the step's spans, with the engine's measured times (core.tracing)."""
        timing, events = report.timing, report.events
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

    def _flush(self, ends: list[SessionEnd] | None = None) -> None:
        """Hand the writer the pending rows and progress, and the ends that must follow them."""
        jobs = self.jobs.values()
        traces = [job.trace for job in jobs if job.recorder.dirty]
        self.output.flush(self.recorder.take([job.recorder for job in jobs]), traces, ends or [])

    def _end(self, endings: list[tuple[SessionJob, str, str, RowEvent | None]]) -> None:
        """End sessions: their outcomes go to the writer with a flush of every row pending (their
        own included), and they leave the loop (no more steps, lease renewals or cancel polls)."""
        if not endings:
            return
        self._flush([session_end(*ending) for ending in endings])
        for job, *_ in endings:
            self.jobs.pop(job.request.request_id, None)


_loop: DeviceBatchLoop | None = None
_loop_lock = threading.Lock()


def device_loop() -> DeviceBatchLoop:
    """This process's loop (one per worker process, so one per device)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = DeviceBatchLoop(conf.MAX_BATCH, conf.PREFILL_CHUNK, conf.SPECULATION_POLICY,
                                    core=conf.ENGINE_CORE == "process")
            suffix_feed.feed_into(_loop.corpora)
        return _loop
