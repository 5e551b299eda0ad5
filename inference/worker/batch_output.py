"""What the batching loop's steps leave behind, published and written off the loop thread.

The loop thread records (batching_loop.py); the threads here do the I/O, in the order the loop
hands it over: the publisher, each step's stream events (one Redis round trip: recorder.publish_step);
the writer, the flushes of token and candidate rows (recorder.BatchRecorder.write), after each of
which the end of each session that left the batch with it is written by one of ``END_WRITERS``
threads (its outcome, its prediction, its metrics, then ``job.done``: lifecycle.write_end; ends
are independent, and a task thread holds its Celery message until its end is written, so ends
written one at a time bounded the sessions a worker could take in: measured, 17 writes waiting
and one session in the batch while 16 task threads waited for their ends).

A flush first waits until the stream events queued before it are published, so a stream never
lags its committed rows and a ``done`` follows its session's last ``tokens`` event; but no stream
event waits behind the database: under a flood of sessions ending (their outcomes written one by
one) a quiet tenant's first tokens waited up to 1.8 s in a single queue (bench/README.md, Abuse).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

from django.db import connections

from core import tracing
from inference.conf import conf
from inference.worker import metrics
from inference.worker.lifecycle import write_end
from inference.worker.recorder import BatchRecorder, PendingFlush, publish_step
from inference.worker.session_job import SessionEnd
from inference.worker.write_behind import MAX_ITEMS, WriteBehind
from sessions.runs import database_retry

logger = logging.getLogger(__name__)

END_WRITERS = 4  # threads writing sessions' ends (each its own transactions), after their flush


class BatchOutput:
    """The publisher, the writer and the end writers of one batching loop.

    ``publish`` and ``flush`` are called from the loop thread only; runs a flush finds stale
    (fencing) go to ``stale`` for the loop thread to drop. ``while_blocked`` runs while the loop
    waits on a full queue (it renews the leases in hand).
    """

    def __init__(self, recorder: BatchRecorder, stale: queue.SimpleQueue[set[tuple[Hashable, int]]],
                 max_items: int = MAX_ITEMS, while_blocked: Callable[[], None] | None = None) -> None:
        self.recorder = recorder
        self.stale = stale
        self.writes = WriteBehind(max_items, while_blocked=while_blocked)
        self.publisher = WriteBehind(max_items, name="specops-stream-publisher", while_blocked=while_blocked)
        # stream publishes queued (loop thread) and done (publisher thread): a flush's barrier
        self._publishes_queued = 0
        self._publishes_done = 0
        self._published = threading.Condition()
        self._enders = ThreadPoolExecutor(END_WRITERS, thread_name_prefix="specops-session-end")
        self._publish_delay_max = 0.0

    # -- the loop thread ------------------------------------------------------------------

    def publish(self, stream_events: list, traces: list) -> None:
        """Queue one step's stream events (one round trip on the publisher thread)."""
        self._publishes_queued += 1
        self.publisher.put(self._publish, stream_events, traces, time.monotonic(), self._publishes_queued)

    def flush(self, pending: PendingFlush, traces: list[tracing.SessionTrace | None], ends: list[SessionEnd]) -> None:
        """Queue one flush of rows, and the ends that must follow it, behind the publishes queued so far."""
        self.writes.put(self._write, pending, traces, ends, self._publishes_queued)

    def take_publish_delay_max(self) -> float:
        """The longest a step's stream events waited for the publisher since the last call (seconds)."""
        delay, self._publish_delay_max = self._publish_delay_max, 0.0
        return delay

    # -- the publisher thread -------------------------------------------------------------

    def _publish(self, stream_events: list, traces: list, queued_at: float, number: int) -> None:
        """A step's stream events (publish_step), timed from the step's report."""
        delay = time.monotonic() - queued_at
        metrics.STREAM_PUBLISH_DELAY_SECONDS.observe(delay)
        self._publish_delay_max = max(self._publish_delay_max, delay)
        try:
            publish_step(stream_events, traces)
        finally:  # a failed publish (logged by the publisher) must not hold the flushes up
            with self._published:
                self._publishes_done = number
                self._published.notify_all()

    # -- the writer thread ----------------------------------------------------------------

    def _wait_for_publishes(self, number: int) -> None:
        """Wait until the stream events queued before this write are published."""
        with self._published:
            if not self._published.wait_for(lambda: self._publishes_done >= number,
                                            timeout=conf.SESSION_LEASE_S / 2):
                logger.warning("stream events still unpublished after %.0f s; writing on",
                               conf.SESSION_LEASE_S / 2)

    def _write(self, pending: PendingFlush, traces: list[tracing.SessionTrace | None],
               ends: list[SessionEnd], publishes: int = 0) -> None:
        """Commit one flush, then write the ends that waited for it, once the first ``publishes``
        stream publishes are done. A failed flush (PostgreSQL restarting, a connection cut) is
        tried again (database_retry: half a lease, at least 10 s) — its transaction rolled back whole
        and its inserts idempotent, so a retry duplicates nothing — before it fails the sessions
        ending with it; the fence refuses the rows of a run taken over meanwhile."""
        self._wait_for_publishes(publishes)

        def flush() -> None:
            with tracing.batch_write(traces, len(pending)):
                stale = self.recorder.write(pending)
            if stale:
                self.stale.put(stale)

        failure = ""
        try:  # any error: a flush that fails for good fails its sessions, whatever the cause
            database_retry.retrying(flush, f"a batch flush of {len(pending)} rows", retry_on=(Exception,))
        except Exception as error:
            logger.exception("a batch flush of %d rows failed", len(pending))
            failure = f"{type(error).__name__}: {error}"
        for end in ends:
            self._enders.submit(self._write_end, end, failure)

    # -- the end writers ------------------------------------------------------------------

    @staticmethod
    def _write_end(end: SessionEnd, failure: str) -> None:
        """One session's end (after its rows' flush), then its database connection back to the pool."""
        try:
            with tracing.activated(end.job.trace):
                write_end(end, failure)
        except Exception:  # write_end sets job.done whatever happens; the thread goes on
            logger.exception("writing the end of session %s failed", end.job.session.pk)
        finally:
            connections.close_all()
