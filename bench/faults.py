"""Faults against a live worker: each session must end exactly once, with every token.

Starts its own services on a database of its own (``specops_bench_faults``, recreated; dropped at
the end unless ``--keep``) and a Redis database of its own (``--redis-db``: broker, streams and
cache, flushed first and by the broker fault), with a tiny random model pair (built in seconds
under ``var/bench-models``): one Celery worker as production runs it (threads pool, prefetch 1,
one batching loop). The reconciler runs in this process every ``--reconcile-every`` seconds, as
beat runs ``inference.reconcile_sessions`` (every 15 s in production, faster here so that a run
takes seconds); leases are ``--lease`` seconds (30 in production) and a queued session gets
another task after ``--requeue-after`` seconds (60 in production).

First each prompt is generated once without a fault (greedy): its tokens are what every faulted
session of that prompt must end with. Then each fault ``--runs`` times, each session of a fresh
tenant (so the prediction cache cannot answer it):

- ``kill_worker``: once the session has committed some tokens (and a random few milliseconds
  later, to land between a step's stream event and its rows' flush), SIGKILL of the worker's
  whole process group; a new worker is started at once.
- ``kill_child``: with ``--pool threads`` there is no child process: the generation runs on a task
  thread of the worker's main process, beside the batching loop's thread. So this SIGKILLs that
  process by its pid (not its group) at a random moment after it claimed the session — often
  before the first commit, during prefill, or between a step's stream event and its flush.
  Under prefork it would be the pool child; the recovery path (lease lapses, reconciler,
  resume) is the same.
- ``broker_flush``: ``--concurrency`` sessions fill the worker's task threads and one more waits
  in the broker; once the running ones have committed tokens, FLUSHDB of the Redis database
  (the waiting task, the running tasks' unacknowledged entries, the streams so far).

A session is ok when it succeeded, its token rows are positions 0..n-1 with n == token_count,
its tokens equal the prompt's unfaulted run, and its stream has exactly one ``done``. A kill
that found the session already finished does not count and is run again. Counted over all:
``duplicate_stream_events`` (extra ``done`` events, and ``tokens`` events of a step already in
the stream: a resumed run re-publishes what the killed one streamed but had not committed),
``lost_sessions`` (not ended ``--deadline`` seconds after the fault) and ``lost_rows`` (tokens of
the unfaulted run missing from the session's rows).

    .venv/bin/python bench/faults.py [--runs 5] [--max-tokens 300] [--redis-db 15]

Last line: ``RESULT kill_child_ok=<k>/<n> kill_worker_ok=<k>/<n> broker_flush_ok=<k>/<n>
duplicate_stream_events=<n> lost_sessions=<n> lost_rows=<n>``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    ADMIN_URL,
    NO_THROTTLES,
    database_url,
    drop_database,
    recreate_database,
    say,
    register_tiny_pair,
    stop_process_group,
)

BENCH_DB = "specops_bench_faults"
LOG_DIR = ROOT / "var" / "bench-faults"
PROMPTS = ("def parse(text):\n    ", "import os\nimport sys\n", "class Node:\n    def __init__(self",
           "for index in range(", "while queue:\n    item = ")
TERMINAL = ("succeeded", "failed", "cancelled")


def bench_environment(args) -> None:
    """The environment of this process and of the worker it starts."""
    os.environ.update({
        "DATABASE_URL": database_url(args.admin_url, BENCH_DB), "DATABASE_REPLICA_URLS": "",
        "REDIS_URL": f"redis://127.0.0.1:6379/{args.redis_db}",
        "SPECOPS_MODEL_DIR": str(ROOT / "var" / "bench-models"), "HF_HUB_OFFLINE": "1",
        "DJANGO_SETTINGS_MODULE": "specops.settings", "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
        "SECRET_KEY": os.environ.get("SECRET_KEY") or secrets.token_urlsafe(40),
        **NO_THROTTLES,
        "SPECOPS_SESSION_LEASE_S": str(args.lease), "SPECOPS_RECONCILE_QUEUED_S": str(args.requeue_after),
        "SPECOPS_SPECULATION_POLICY": "false",  # fixed drafts: every run of a prompt takes the same steps
        "OMP_NUM_THREADS": str(args.torch_threads),
    })
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):  # both are REDIS_URL's database
        os.environ.pop(name, None)


def prepare() -> None:
    """Migrate, flush the Redis database, register the tiny pair (as the active target)."""
    import django

    django.setup()
    from django.core.management import call_command

    from metadata.sessions import token_stream

    token_stream.client().flushdb()
    call_command("migrate", verbosity=0)
    register_tiny_pair()


class Worker:
    """One ``celery worker -Q cpu`` process (threads pool), as production runs it."""

    started = 0

    def __init__(self, concurrency: int) -> None:
        Worker.started += 1
        self.node = f"faults-{Worker.started}@benchhost"
        self.log = LOG_DIR / f"worker-{Worker.started}.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "specops", "worker", "-Q", "cpu", "-n", self.node,
             "--pool", "threads", "--concurrency", str(concurrency), "--prefetch-multiplier", "1",
             "--without-gossip", "--without-mingle", "-l", "INFO"],
            cwd=ROOT, env=os.environ.copy(), stdout=self.log.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + 120
        while f"{self.node} ready." not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"worker {self.node} did not start; see {self.log}")
            time.sleep(0.2)

    def kill_group(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def kill_pid(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
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

        from inference.worker.reconciler import reconcile_sessions
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


def new_client():
    """An API client of a fresh user and tenant: the prediction cache has nothing for it."""
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    from metadata.models import Tenant, TenantMembership

    name = f"faults-{secrets.token_hex(4)}"
    user = get_user_model().objects.create_user(name)
    TenantMembership.objects.create(user=user, tenant=Tenant.objects.create(name=name))
    client = APIClient()
    client.force_authenticate(user=user)
    return client


def submit(prompt: str, max_tokens: int) -> str:
    response = new_client().post("/api/v1/generations/", {"prompt": prompt, "max_new_tokens": max_tokens,
                                                          "drafter": "draft_model"}, format="json")
    if response.status_code != 202:
        raise SystemExit(f"generation refused or cached: {response.status_code} {response.content[:200]!r}")
    return str(response.json()["id"])


def session_row(session_id: str) -> dict:
    from metadata.models import Session

    return Session.objects.values("status", "token_count", "attempts", "error").get(pk=session_id)


def committed(session_id: str) -> int:
    from metadata.models import TokenRecord

    return TokenRecord.objects.filter(session_id=session_id).count()


def token_rows(session_id: str) -> list[tuple[int, int]]:
    from metadata.models import TokenRecord

    return list(TokenRecord.objects.filter(session_id=session_id).order_by("position")
                .values_list("position", "token_id"))


def wait(probe, timeout: float, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(interval)
    return None


def ended(session_id: str, timeout: float) -> bool:
    return bool(wait(lambda: session_row(session_id)["status"] in TERMINAL, timeout, interval=0.1))


@dataclass
class Outcome:
    """How one session ended, checked against the unfaulted run of its prompt."""

    session_id: str
    ended: bool
    status: str
    attempts: int
    rows_ok: bool  # positions 0..n-1, n == token_count, tokens equal the unfaulted run's
    lost_rows: int
    done_events: int
    repeated_steps: int

    @property
    def ok(self) -> bool:
        return self.ended and self.status == "succeeded" and self.rows_ok and self.done_events == 1

    def line(self) -> str:
        return (f"status={self.status} attempts={self.attempts} rows_ok={self.rows_ok} lost_rows={self.lost_rows} "
                f"done_events={self.done_events} repeated_steps={self.repeated_steps}")


def stream_counts(session_id: str) -> tuple[int, int]:
    """(``done`` events, ``tokens`` events of a step already seen) in the session's Redis stream."""
    from metadata.sessions import token_stream

    done, repeated, steps = 0, 0, set()
    for _entry_id, fields in token_stream.client().xrange(token_stream.stream_key(session_id)):
        event = fields[b"event"].decode()
        if event == "done":
            done += 1
        elif event == "tokens":
            step = json.loads(fields[b"data"])["step"]
            repeated += step in steps
            steps.add(step)
    return done, repeated


def outcome(session_id: str, expected: list[int], deadline: float) -> Outcome:
    has_ended = ended(session_id, deadline)
    row = session_row(session_id)
    rows = token_rows(session_id)
    positions_ok = [position for position, _ in rows] == list(range(len(rows))) and row["token_count"] == len(rows)
    tokens = [token for _, token in rows]
    # The final event goes out just after the final row commits: give it a moment.
    wait(lambda: stream_counts(session_id)[0], 5.0, interval=0.05)
    done, repeated = stream_counts(session_id)
    return Outcome(session_id, has_ended, row["status"], row["attempts"], positions_ok and tokens == expected,
                   max(0, len(expected) - len(rows)), done, repeated)


class FaultBench:
    def __init__(self, args) -> None:
        self.args = args
        self.worker = Worker(args.concurrency)
        self.expected: dict[str, list[int]] = {}
        self.outcomes: dict[str, list[Outcome]] = {"kill_child": [], "kill_worker": [], "broker_flush": []}
        self.missed = {"kill_child": 0, "kill_worker": 0}

    def baselines(self) -> None:
        for prompt in PROMPTS:
            session_id = submit(prompt, self.args.max_tokens)
            if not ended(session_id, 300) or session_row(session_id)["status"] != "succeeded":
                raise SystemExit(f"the unfaulted run of {prompt!r} did not succeed: {session_row(session_id)}")
            self.expected[prompt] = [token for _, token in token_rows(session_id)]
            say(f"unfaulted {prompt!r}: {len(self.expected[prompt])} tokens")

    def kill(self, kind: str, run: int) -> None:
        """One kill run (retried when the kill came after the session had ended)."""
        prompt = PROMPTS[run % len(PROMPTS)]
        for _attempt in range(3):
            session_id = submit(prompt, self.args.max_tokens)
            if kind == "kill_worker":
                threshold = min(random.randint(5, 40), len(self.expected[prompt]) // 3)
                wait(lambda sid=session_id, n=threshold: committed(sid) >= n, 120)
                time.sleep(random.uniform(0.0, 0.25))
                at_kill = committed(session_id)
                self.worker.kill_group()
            else:
                wait(lambda sid=session_id: session_row(sid)["status"] == "running", 120)
                time.sleep(random.uniform(0.05, 1.5))
                at_kill = committed(session_id)
                self.worker.kill_pid()
            status = session_row(session_id)["status"]
            self.worker = Worker(self.args.concurrency)
            if status in TERMINAL:  # the fault came too late to be one
                self.missed[kind] += 1
                continue
            result = outcome(session_id, self.expected[prompt], self.args.deadline)
            self.outcomes[kind].append(result)
            say(f"{kind} {run + 1}: killed at {at_kill} committed tokens; {result.line()}")
            return
        say(f"{kind} {run + 1}: every kill came after the session ended (generation too short?)")

    def broker_flush(self, run: int) -> None:
        from metadata.sessions import token_stream

        prompts = [PROMPTS[(run + offset) % len(PROMPTS)] for offset in range(self.args.concurrency + 1)]
        ids = [submit(prompt, self.args.max_tokens) for prompt in prompts]
        wait(lambda: all(committed(session_id) >= 1 for session_id in ids[:-1]), 120)
        before = [(session_row(session_id)["status"], committed(session_id)) for session_id in ids]
        token_stream.client().flushdb()
        for prompt, session_id, (status, rows) in zip(prompts, ids, before):
            result = outcome(session_id, self.expected[prompt], self.args.deadline)
            self.outcomes["broker_flush"].append(result)
            say(f"broker_flush {run + 1}: {status} with {rows} committed tokens at the flush; {result.line()}")

    def result_line(self) -> str:
        def ok(kind: str) -> str:
            outcomes = self.outcomes[kind]
            return f"{sum(o.ok for o in outcomes)}/{len(outcomes)}"

        every = [o for outcomes in self.outcomes.values() for o in outcomes]
        duplicates = sum(o.repeated_steps + max(0, o.done_events - 1) for o in every)
        lost_sessions = sum(not o.ended for o in every)
        lost_rows = sum(o.lost_rows for o in every)
        return (f"RESULT kill_child_ok={ok('kill_child')} kill_worker_ok={ok('kill_worker')} "
                f"broker_flush_ok={ok('broker_flush')} duplicate_stream_events={duplicates} "
                f"lost_sessions={lost_sessions} lost_rows={lost_rows}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each fault")
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=2, help="task threads of the worker")
    parser.add_argument("--lease", type=float, default=3.0, help="SPECOPS_SESSION_LEASE_S")
    parser.add_argument("--requeue-after", type=float, default=10.0, help="SPECOPS_RECONCILE_QUEUED_S")
    parser.add_argument("--reconcile-every", type=float, default=1.0, help="seconds between reconciler passes")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds after a fault a session must end in")
    parser.add_argument("--torch-threads", type=int, default=1, help="OMP_NUM_THREADS of the worker")
    parser.add_argument("--admin-url", default=ADMIN_URL)
    parser.add_argument("--redis-db", type=int, default=15, help="flushed: give the bench a database of its own")
    parser.add_argument("--seed", type=int, default=0, help="of the kill timings")
    parser.add_argument("--keep", action="store_true", help="keep the bench database")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    random.seed(args.seed)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    bench_environment(args)
    recreate_database(args.admin_url, BENCH_DB)
    bench = None
    reconciler = None
    try:
        prepare()
        started = time.monotonic()
        bench = FaultBench(args)
        reconciler = ReconcilerThread(args.reconcile_every)
        reconciler.start()
        bench.baselines()
        for run in range(args.runs):
            bench.kill("kill_child", run)
            bench.kill("kill_worker", run)
            bench.broker_flush(run)
        say(f"reconciler: {reconciler.passes}; kills that came too late (run again): {bench.missed}; "
            f"{time.monotonic() - started:.0f} s; worker logs in {LOG_DIR}")
        say(bench.result_line())
    finally:
        if reconciler is not None:
            reconciler.stopped.set()
            reconciler.join(timeout=10)
        if bench is not None:
            bench.worker.stop()
        from django.db import connections

        connections.close_all()
        if not args.keep:
            drop_database(args.admin_url, BENCH_DB)


if __name__ == "__main__":
    main()
