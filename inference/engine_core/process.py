"""The engine-core process: ``python -m inference.engine_core.process`` (started by client.py).

It connects to the two sockets its front bound (requests in, reports out), loads models as
submits and preloads name them, and loops: take every message waiting (so requests that
arrived during a step are admitted together and prefill in one forward), step every engine with
work, send each step's report. It blocks only when it has nothing to step. It exits when its
front goes (it checks its parent's pid each turn, at least every half second), so a front that
dies leaves its sessions to the reconciler and no orphan holds the device.

No Django, ORM, Redis or Celery here: its only I/O is the two sockets.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

import zmq

from inference.engine_core.engines import LocalEngines
from inference.engine_core.model_residency import ModelResidency
from inference.engine_core.protocol import (
    AddToCorpus,
    Cancel,
    DropPairs,
    EngineSettings,
    Heartbeat,
    Preload,
    Ready,
    Refused,
    Replay,
    ReplayDone,
    Submit,
)

logger = logging.getLogger("inference.engine_core")

IDLE_POLL_MS = 500  # how long an idle core waits for a message before it checks on its parent
HEARTBEAT_S = 1.0
SEND_TIMEOUT_MS = 1000


class EngineCore:
    """The core's loop over its two sockets and its engines."""

    def __init__(self, settings: EngineSettings, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
        self.models = ModelResidency(settings.resident_models, settings.onednn_linear, freeze_loaded=True)
        self.engines = LocalEngines(settings, self.models)
        self.inbox, self.outbox, self.parent_pid = inbox, outbox, parent_pid
        self._last_sent = time.monotonic()

    def run(self) -> None:
        self._send(Ready(os.getpid()))
        while os.getppid() == self.parent_pid:
            busy = self.engines.has_work()
            if self.inbox.poll(0 if busy else IDLE_POLL_MS):
                self._take_messages()
            for report in self.engines.step(send=self._send):  # early reports are sent from within
                self._send(report)
            if time.monotonic() - self._last_sent >= HEARTBEAT_S:
                self._send(Heartbeat(time.time()))
        logger.warning("engine core %d: its front (pid %d) is gone; exiting", os.getpid(), self.parent_pid)

    def _take_messages(self) -> None:
        while True:
            try:
                message = self.inbox.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.handle(message)
            except Exception:  # one bad message must not stop the device
                logger.exception("engine core: handling %s failed", type(message).__name__)

    def handle(self, message) -> None:
        if isinstance(message, Submit):
            self._submit(message)
        elif isinstance(message, Cancel):
            self.engines.cancel(message.request_id)
        elif isinstance(message, AddToCorpus):
            from inference.engine.drafters.suffix import suffix_corpora

            suffix_corpora.add(message.key, list(message.sequence))
        elif isinstance(message, DropPairs):
            self.engines.drop(message.pairs, message.keep)
        elif isinstance(message, Preload):
            for spec in message.specs:  # one version that fails to load leaves the others loaded
                try:
                    self.models.get(spec)
                    self.models.dspark(spec)
                except Exception:
                    logger.exception("engine core: preloading %s failed", spec)
        elif isinstance(message, Replay):
            try:
                tokens = self.engines.replay(self.models.get(message.target), message.prompt_ids, message.config)
                self._send(ReplayDone(message.ticket, tokens))
            except Exception as error:
                self._send(ReplayDone(message.ticket, error=f"{type(error).__name__}: {error}"))
        else:
            logger.error("engine core: unknown message %r", message)

    def _submit(self, message: Submit) -> None:
        try:
            target = self.models.get(message.target)
            draft = self.models.get(message.draft) if message.draft is not None else None
            dspark = self.models.dspark(message.target) if message.dspark else None
            self.engines.submit(message.pair, message.request, target, draft, dspark)
        except Exception as error:  # a load or the engine's refusal ends this session only
            logger.exception("engine core: session %s refused", message.request.request_id)
            self._send(Refused(message.request.request_id, message.pair, f"{type(error).__name__}: {error}"))

    def _send(self, message) -> None:
        """Send a report; a front that stopped reading (gone, or paused) holds the core here, and
        a front that is gone ends it."""
        while True:
            try:
                self.outbox.send_pyobj(message)  # the socket's send timeout: SEND_TIMEOUT_MS
                break
            except zmq.Again:
                if os.getppid() != self.parent_pid:
                    raise SystemExit(0) from None
        self._last_sent = time.monotonic()


def live_with_parent() -> None:
    """The core's lifetime is its front's: it ignores the SIGTERM and SIGINT sent to the whole
    process group (a warm shutdown of the worker still needs it to finish the sessions in hand)
    and exits when its parent is gone (the loop checks the parent's pid every turn). Not
    PR_SET_PDEATHSIG: Linux ties that to the parent *thread* that started the core, and a task
    thread of the worker may start it and end."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="SpecOps engine core (started by its worker)")
    parser.add_argument("--requests", required=True, help="ZMQ endpoint the front pushes requests to")
    parser.add_argument("--reports", required=True, help="ZMQ endpoint the front pulls reports from")
    parser.add_argument("--parent", type=int, required=True, help="the front's pid")
    parser.add_argument("--settings", required=True, help="EngineSettings as JSON")
    args = parser.parse_args(argv)
    live_with_parent()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s engine-core[%(process)d] %(levelname)s %(name)s: %(message)s")
    if os.getppid() != args.parent:
        return 1  # the front died while this process started
    settings = EngineSettings(**json.loads(args.settings))
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    inbox.connect(args.requests)
    outbox.connect(args.reports)
    try:
        EngineCore(settings, inbox, outbox, args.parent).run()
    finally:
        context.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
