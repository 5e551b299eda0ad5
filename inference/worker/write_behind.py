"""The batching loop's writes, off the loop thread: one writer thread per loop, in FIFO order.

The loop thread only computes (the step, its rows, its events, a session's outcome) and hands
each write (the step's stream events to Redis, token and candidate rows to PostgreSQL, the end
of every session that finished) to this thread as one work item, so its forwards do not wait on
PostgreSQL and Redis: written on the loop thread, they kept the model idle for ~28 % of the
loop's wall time in a profile.

Ordering: one writer runs the items in the order they were put, so whatever the loop hands over
in order is written in that order. For a session this means: its ``tokens`` events are published
before its ``done``; its token and candidate rows are committed (by the flush its end rides
with) before `finish_session` marks it ended; its task thread's ``job.done`` is set only after
its outcome is written, so Celery's late ack still means "written". Keep it one writer.

Backpressure: at most ``max_items`` items wait; when the writer falls that far behind (PostgreSQL
or Redis slow), `put` blocks the loop until it catches up, so memory cannot grow without limit.
While it blocks it calls ``while_blocked`` about once a second (the loop renews its leases).

Failure: an item that raises is logged, the thread's database connection is checked
(`close_old_connections`, as the loop does) and the writer goes on with the next item. An item
that ends sessions handles its own failures: it marks them failed and sets their ``job.done``.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from django.db import close_old_connections, connections

from inference.worker import metrics

logger = logging.getLogger(__name__)

MAX_ITEMS = 256  # a step puts one or two; a flush carries at most a few hundred rows
LIVENESS_CHECK_S = 1.0  # a put blocked this long checks that the writer is still there
_STOP = object()  # the item that ends the writer thread (WriteBehind.close)


class WriteBehind:
    """A thread that runs the work items it is given, one at a time, in the order given."""

    def __init__(self, max_items: int = MAX_ITEMS, name: str = "specops-batch-writer",
                 while_blocked: Callable[[], object] | None = None) -> None:
        self.max_items = max_items
        self.name = name
        # called about every LIVENESS_CHECK_S while a `put` waits for room (the loop renews its
        # sessions' leases there: a loop held up longer than a lease must not look dead)
        self.while_blocked = while_blocked
        self.failures = 0  # items that raised
        self._items: queue.Queue[tuple[Callable[..., object] | object, tuple]] = queue.Queue(maxsize=max_items)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, write: Callable[..., object], *args: object) -> None:
        """Run ``write(*args)`` on the writer thread after everything put before; block while
        ``max_items`` items wait."""
        self._ensure_running()
        while True:
            try:
                self._items.put((write, args), timeout=LIVENESS_CHECK_S)
                return
            except queue.Full:
                self._ensure_running()
                if self.while_blocked is not None:
                    try:
                        self.while_blocked()
                    except Exception:  # the item still goes in: it must not be lost
                        logger.exception("a write's wait for room: its callback failed")

    def close(self) -> None:
        """Stop the writer once the items put so far have run (its database connections close);
        a later `put` starts another."""
        with self._lock:
            thread = self._thread
        if thread is not None and thread.is_alive():
            self._items.put((_STOP, ()))
            thread.join()

    def join(self) -> None:
        """Wait until every item put so far has run."""
        self._items.join()

    @property
    def waiting(self) -> int:
        """Items put and not yet taken by the writer."""
        return self._items.qsize()

    def _ensure_running(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            write, args = self._items.get()
            if write is _STOP:
                connections.close_all()  # this thread's
                self._items.task_done()
                return
            try:
                write(*args)
            except Exception:  # the writer must outlive any one write
                self.failures += 1
                metrics.BATCH_WRITER_FAILURES.inc()
                logger.exception("a batch write failed")
                close_old_connections()
            finally:
                self._items.task_done()
