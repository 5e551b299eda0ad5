"""The fault bench's processes (bench/faults.py): device workers it starts, kills, pauses and
restarts, on this host or on hosts of their own (scripts/netns_hosts.py), and the reconciler
pass that beat runs in production.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import say, stop_process_group
from scripts import netns_hosts

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = ROOT / "var" / "bench-faults"


def copy_models(run_dir: Path, role: str) -> Path:
    """A worker host's own model directory: a copy of the web's (the registry stores paths
    relative to SPECOPS_MODEL_DIR, so each host resolves them on its own disk)."""
    target = run_dir / f"models-{role}"
    shutil.copytree(os.environ["SPECOPS_MODEL_DIR"], target)
    return target


class Worker:
    """One ``celery worker -Q cpu`` process (threads pool), as production runs it: on this host,
    or on worker host ``role`` of ``hosts`` with the models of ``model_dir``."""

    started = 0

    def __init__(self, concurrency: int, hosts: netns_hosts.Hosts | None = None, role: str = "local",
                 model_dir: Path | None = None, wait_ready: bool = True) -> None:
        Worker.started += 1
        self.concurrency, self.hosts, self.role, self.model_dir = concurrency, hosts, role, model_dir
        self.node = f"faults-{Worker.started}@{role}"
        self.log = LOG_DIR / f"worker-{Worker.started}-{role}.log"
        argv = [sys.executable, "-m", "celery", "-A", "specops", "worker", "-Q", "cpu", "-n", self.node,
                "--pool", "threads", "--concurrency", str(concurrency), "--prefetch-multiplier", "1",
                "--without-gossip", "--without-mingle", "-l", "INFO"]
        if hosts is None:
            self.process = subprocess.Popen(argv, cwd=ROOT, env=os.environ.copy(), stdout=self.log.open("w"),
                                            stderr=subprocess.STDOUT, start_new_session=True)
        else:
            env = {**os.environ, "SPECOPS_MODEL_DIR": str(model_dir)}
            self.process = hosts.start(role, argv, self.log, env=env, cwd=ROOT)
        if wait_ready:
            self.ready()

    def ready(self) -> Worker:
        deadline = time.monotonic() + 120
        while f"{self.node} ready." not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"worker {self.node} did not start; see {self.log}")
            time.sleep(0.2)
        return self

    def kill_group(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def kill_pid(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def pause(self) -> None:
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def again(self) -> Worker:
        """A new worker where this one ran."""
        return Worker(self.concurrency, self.hosts, self.role, self.model_dir)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.resume()  # a paused worker cannot exit
        stop_process_group(self.process)


class ReconcilerThread(threading.Thread):
    """What beat does in production: a reconciler pass every ``every`` seconds."""

    def __init__(self, every: float) -> None:
        super().__init__(name="bench-reconciler", daemon=True)
        self.every = every
        self.stopped = threading.Event()
        self.passes = {"resumed": 0, "requeued": 0, "failed": 0}

    def run(self) -> None:
        from django.db import connection

        from sessions.runs.reconciler import reconcile_sessions
        from metadata.partitions import MaintenanceLockBusy

        while not self.stopped.wait(self.every):
            try:
                report = reconcile_sessions()
            except MaintenanceLockBusy:
                continue
            except Exception as exc:  # noqa: BLE001  (keep reconciling: a pass during a flush may fail)
                say(f"  reconciler pass failed: {type(exc).__name__}: {exc}")
                connection.close()
                continue
            for kind in self.passes:
                self.passes[kind] += len(getattr(report, kind))
