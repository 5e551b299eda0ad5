"""The front's handle on its engine core: starts the process, feeds it, drains its reports.

Channel: two ZMQ PUSH/PULL pairs over ipc sockets in a private temporary directory, bound here and
connected by the core. ZMQ rather than a multiprocessing pipe because a send never blocks on
the other side's reading (messages queue in ZMQ's own I/O thread, off the GIL), the front can
wait on it with a timeout, and a restarted core reconnects to the same endpoints; rather than
shared memory because a step's reports are small (tokens, not tensors).

`CoreClient` offers what the batching loop asks of `LocalEngines` (submit, cancel, step,
idle_pairs, drop, replay), so the loop is one code path whichever runs the engines. Thread use:
any thread may send (a lock guards the request socket); only the loop thread calls `step`.

A core that dies is started again; `step` then returns `CoreRestarted`, and the loop submits
its sessions again from the tokens they already have (lossless: committed tokens are prefilled,
never generated again).
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

import zmq

from inference.engine_core.protocol import (
    AddToCorpus,
    Cancel,
    DropPairs,
    EngineSettings,
    Heartbeat,
    ModelSpec,
    Pair,
    Preload,
    Ready,
    Refused,
    Replay,
    ReplayDone,
    StepReport,
    Submit,
)

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0  # torch's import and the first model loads on a loaded 2-core machine
BUSY_WAIT_S = 0.005  # how long `step` waits for a report while sessions run (a newcomer waits at most this)
REPLAY_TIMEOUT_S = 600.0


class CoreStartFailed(RuntimeError):
    """The engine core did not say it was ready in time (or exited first)."""


@dataclasses.dataclass(frozen=True)
class CoreRestarted:
    """The core died and a new one runs: every row it held is gone."""

    pid: int


@dataclasses.dataclass
class RemoteModel:
    """A model version as the front holds it when a core runs the engines: its tokenizer only."""

    spec: ModelSpec
    tokenizer: object


class RemoteCorpora:
    """The suffix drafter's corpora as the front feeds them: each add goes to the core."""

    def __init__(self, client: CoreClient, max_corpora: int) -> None:
        self.client, self.max_corpora = client, max_corpora
        self._keys: OrderedDict[Hashable, None] = OrderedDict()  # as the core's corpora are bounded

    def add(self, key: Hashable, sequence) -> None:
        self.client.send(AddToCorpus(key, tuple(sequence)))
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_corpora:
            self._keys.popitem(last=False)

    def __len__(self) -> int:
        """The corpora fed through this front (the core holds them, bounded alike)."""
        return len(self._keys)


class CoreClient:
    """One engine core process, started on construction, restarted when it dies."""

    def __init__(self, settings: EngineSettings, while_waiting: Callable[[], None] | None = None,
                 start_timeout: float = START_TIMEOUT_S) -> None:
        self.settings = settings
        self.while_waiting = while_waiting
        self.start_timeout = start_timeout
        self._dir = tempfile.mkdtemp(prefix="specops-core-")
        atexit.register(shutil.rmtree, self._dir, True)
        self._context = zmq.Context()
        self._requests = self._context.socket(zmq.PUSH)
        self._reports = self._context.socket(zmq.PULL)
        self.requests_endpoint = f"ipc://{self._dir}/requests"
        self.reports_endpoint = f"ipc://{self._dir}/reports"
        self._requests.bind(self.requests_endpoint)
        self._reports.bind(self.reports_endpoint)
        self._send_lock = threading.Lock()
        self._pairs: set[Pair] = set()
        self._tickets = itertools.count(1)
        self._replies: dict[int, list] = {}  # ticket -> [Event, ReplayDone | None]
        self.process: subprocess.Popen | None = None
        self.closed = False
        self.restarts = 0
        self.pid = self._start()
        atexit.register(self.close)

    # -- the process ------------------------------------------------------------------------

    def _start(self) -> int:
        command = [sys.executable, "-m", "inference.engine_core.process",
                   "--requests", self.requests_endpoint, "--reports", self.reports_endpoint,
                   "--parent", str(os.getpid()), "--settings", json.dumps(dataclasses.asdict(self.settings))]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise CoreStartFailed(f"the engine core exited with {self.process.returncode} as it started")
            if self._reports.poll(200):
                message = self._reports.recv_pyobj()
                if isinstance(message, Ready):
                    logger.info("engine core %d ready", message.pid)
                    return message.pid
            if self.while_waiting is not None:
                self.while_waiting()
        self.process.kill()
        raise CoreStartFailed(f"the engine core was not ready within {self.start_timeout:g} s")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _restart(self) -> CoreRestarted:
        logger.error("engine core %d died (exit %s); starting another", self.pid, self.process.returncode)
        self.restarts += 1
        self._pairs.clear()
        for ticket, reply in list(self._replies.items()):
            reply[1] = ReplayDone(ticket, error="the engine core died")
            reply[0].set()
        while True:
            try:
                self.pid = self._start()
                return CoreRestarted(self.pid)
            except CoreStartFailed:
                logger.exception("engine core restart failed; trying again")
                time.sleep(1.0)

    def close(self) -> None:
        self.closed = True
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self._context.destroy(linger=0)

    # -- what the loop asks of its engines ----------------------------------------------------

    def send(self, message) -> None:
        with self._send_lock:
            self._requests.send_pyobj(message)

    def submit(self, pair: Pair, request, target: RemoteModel, draft: RemoteModel | None, dspark) -> None:
        self._pairs.add(pair)
        self.send(Submit(pair, request, target.spec, draft.spec if draft is not None else None,
                         dspark=bool(dspark)))

    def cancel(self, request_id: Hashable) -> None:
        self.send(Cancel(request_id))

    def idle_pairs(self) -> list[Pair]:
        """The pairs this front ever sent (the core keeps an engine with rows when asked to drop it)."""
        return list(self._pairs)

    def drop(self, pairs, keep=frozenset()) -> list[Pair]:
        pairs = tuple(pairs)
        self._pairs.difference_update(pairs)
        self.send(DropPairs(pairs, frozenset(keep)))
        return list(pairs)

    def preload(self, specs) -> None:
        self.send(Preload(tuple(specs)))

    def step(self, wait: bool = True) -> list:
        """The core's reports since the last call (StepReport, Refused, or CoreRestarted), waiting
        up to BUSY_WAIT_S for the first when ``wait``."""
        if self.closed:
            return []
        if not self.alive():
            return [self._restart()]
        out = []
        timeout = int(BUSY_WAIT_S * 1000) if wait else 0
        while self._reports.poll(timeout):
            timeout = 0
            message = self._reports.recv_pyobj()
            if isinstance(message, (StepReport, Refused)):
                out.append(message)
            elif isinstance(message, ReplayDone):
                reply = self._replies.get(message.ticket)
                if reply is not None:
                    reply[1] = message
                    reply[0].set()
            elif not isinstance(message, (Heartbeat, Ready)):
                logger.error("engine core sent an unknown message %r", message)
        return out

    def replay(self, target: RemoteModel, prompt_ids, config) -> list[int]:
        """The target's own greedy tokens, computed by the core (the loop thread delivers the answer)."""
        ticket = next(self._tickets)
        reply = self._replies[ticket] = [threading.Event(), None]
        try:
            self.send(Replay(ticket, target.spec, tuple(prompt_ids), config))
            if not reply[0].wait(REPLAY_TIMEOUT_S):
                raise TimeoutError("the engine core did not answer the replay")
            done: ReplayDone = reply[1]
        finally:
            self._replies.pop(ticket, None)
        if done.error:
            raise RuntimeError(done.error)
        return list(done.token_ids)
