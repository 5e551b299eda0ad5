"""Faults against a live worker: each session must end exactly once, with every token.

Starts its own services on a database of its own (``--database``, ``specops_bench_faults`` by
default, recreated; dropped at the end unless ``--keep``) and a Redis database of its own (``--redis-db``: broker, streams and
cache, flushed first and by the broker fault), with a tiny random model pair (built in seconds
under ``var/bench-models``): one Celery worker as production runs it (threads pool, prefetch 1,
one batching loop). The reconciler runs in this process every ``--reconcile-every`` seconds, as
beat runs ``inference.reconcile_sessions`` (every 15 s in production, faster here so that a run
takes seconds); leases are ``--lease`` seconds (30 in production) and a queued session gets
another task after ``--requeue-after`` seconds (60 in production).

Each prompt is first generated once without a fault (greedy; when a fault first needs it): its
tokens are what every faulted greedy session of that prompt must end with. Then each fault
``--runs`` times on a greedy session and again on a sampled one (temperature 1, no seed; its
drafter cycles through ``SAMPLED_DRAFTERS``), each session of a fresh tenant (so the prediction
cache cannot answer it) and followed from its first event by a stream client
(bench/fault_streams.py: the web's own follow, opened again after the last event it got whenever
it breaks):

- ``kill_worker``: once the session has committed some tokens (and a random few milliseconds
  later, to land between a step's stream event and its rows' flush), SIGKILL of the worker's
  whole process group; a new worker is started at once.
- ``kill_child``: with ``--pool threads`` there is no child process: the generation runs on a task
  thread of the worker's main process, beside the batching loop's thread. So this SIGKILLs that
  process by its pid (not its group) at a random moment after it claimed the session — often
  before the first commit, during prefill, or between a step's stream event and its flush.
  Under prefork it would be the pool child; the recovery path (lease lapses, reconciler,
  resume) is the same.
- ``broker_flush``: ``--concurrency`` sessions per worker fill the task threads and one more
  waits in the broker (every other one sampled); once the running ones have committed tokens,
  FLUSHDB of the Redis database (the waiting task, the running tasks' unacknowledged entries, the
  streams so far).

With ``--hosts netns`` the services and the workers are on hosts of their own, network namespaces
the bench makes and removes (``scripts/netns_hosts.py``): PostgreSQL, Redis (cache and streams)
and the broker (a second Redis) on a services host, one worker on each of two worker hosts with
its own copy of the models, and this process (the web host, and beat's reconciler) reaching them
over the namespaces' subnet. The faults above then hit the worker that runs the session, the
broker flush flushes the broker, and these cases follow (issue 27):

- ``pause``: once the session has committed some tokens, SIGSTOP of its worker until the other
  host's worker has taken the session over (its lease lapsed, the reconciler re-queued it) and
  0-3 s more, then SIGCONT: the woken run must write nothing more (its fence is stale).
- ``partition``: the session's worker host is cut off the network (its link down) until the
  other host took the session over and 0-3 s more, then healed.
- ``restart_postgres``, ``restart_redis``, ``restart_broker`` (``restart_ok`` counts the three):
  a fast shutdown and a start of that service mid-generation (Redis and the broker keep nothing
  over a restart).

A worker that exited on its own (a broker restart can end one: kombu's reconnection raises) is
started again before the next fault, as the unit's ``Restart=on-failure`` does, and named in the
summary line.

A session is ok when it succeeded, its token rows are positions 0..n-1 with n == token_count,
its tokens equal the prompt's unfaulted run (and its text that run's text; a sampled session's
text, its rows' tokens decoded), it has no more than ``--max-tokens`` tokens, its stream has
exactly one ``done``, and the tokens its stream client was streamed are a prefix of its stored
ones. A fault that found the session already finished does not count and is run again. Counted over all:
``duplicate_stream_events`` (extra ``done`` events, and ``tokens`` events of a step already in
the stream: a resumed run re-publishes what the killed one streamed but had not committed),
``lost_sessions`` (not ended ``--deadline`` seconds after the fault), ``lost_rows`` (tokens of
the unfaulted run missing from the session's rows), ``duplicate_tokens`` (rows of a position
another row has), ``over_max_tokens`` (sessions with more tokens than asked for),
``text_mismatch`` (sessions whose text is not the unfaulted run's) and ``stream_mismatch``
(sessions whose client was streamed tokens that are not a prefix of the stored ones);
``sampled_ok`` counts the sampled sessions among all.

    .venv/bin/python bench/faults.py [--runs 5] [--max-tokens 900] [--redis-db 15]
    .venv/bin/python bench/faults.py --hosts netns [--runs 5] [--cases pause,partition,...]   (root)

Last line: ``RESULT kill_child_ok=<k>/<n> kill_worker_ok=<k>/<n> broker_flush_ok=<k>/<n>
duplicate_stream_events=<n> lost_sessions=<n> lost_rows=<n> pause_ok=<k>/<n> partition_ok=<k>/<n>
restart_ok=<k>/<n> duplicate_tokens=<n> over_max_tokens=<n> text_mismatch=<n> sampled_ok=<k>/<n>
stream_mismatch=<n>`` (a case not run is 0/0).
"""
from __future__ import annotations

import argparse
import random
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import ADMIN_URL, drop_database, recreate_database, say  # noqa: E402
from bench.fault_outcomes import (  # noqa: E402
    RESTARTS,
    TERMINAL,
    Expected,
    Outcome,
    committed,
    ended,
    outcome,
    progressed,
    read,
    result_line,
    session_row,
    submit,
    token_rows,
    wait,
)
from bench.fault_setup import bench_environment, prepare  # noqa: E402
from bench.fault_streams import StreamClients  # noqa: E402
from bench.fault_workers import LOG_DIR, ReconcilerThread, Worker, copy_models  # noqa: E402
from scripts import netns_hosts  # noqa: E402

BENCH_DB = "specops_bench_faults"
PROMPTS = ("def parse(text):\n    ", "import os\nimport sys\n", "class Node:\n    def __init__(self",
           "for index in range(", "while queue:\n    item = ")
LOCAL_CASES = ("kill_child", "kill_worker", "broker_flush")
NETNS_CASES = (*LOCAL_CASES, "pause", "partition", *RESTARTS)
SAMPLED_DRAFTERS = ("draft_model", "ngram", "tree", "suffix")  # a sampled session's, by run
KINDS = ("greedy", "sampled")  # each fault run hits one session of each
ATTEMPTS = 5  # sessions a fault run may submit before one is still running when the fault comes


class FaultBench:
    def __init__(self, args, decode: Callable[[list[int]], str], hosts: netns_hosts.Hosts | None = None,
                 services: netns_hosts.Services | None = None, run_dir: Path | None = None) -> None:
        self.args, self.decode, self.hosts, self.services = args, decode, hosts, services
        self.clients = StreamClients()
        if hosts is None:
            self.workers = {"local": Worker(args.concurrency)}
        else:
            self.workers = {role: Worker(args.concurrency, hosts, role, copy_models(run_dir, role), wait_ready=False)
                            for role in hosts.WORKERS}  # both start at once
            for worker in self.workers.values():
                worker.ready()
        self._expected: dict[str, Expected] = {}
        self.outcomes: dict[str, list[Outcome]] = {case: [] for case in NETNS_CASES}
        self.missed: dict[str, int] = {}
        self.exited: list[str] = []  # workers that exited on their own (and were started again)

    @property
    def worker(self) -> Worker:  # the local worker
        return self.workers["local"]

    def worker_of(self, session_id: str) -> Worker | None:
        """The worker whose host ran the session's latest claim (the claim writes its hostname)."""
        if self.hosts is None:
            return self.worker
        hostname = session_row(session_id)["worker"]
        return next((w for role, w in self.workers.items() if hostname == f"{role}-{self.hosts.suffix}"), None)

    def expected(self, prompt: str) -> Expected:
        """The prompt's unfaulted run, generated the first time a fault needs it."""
        if prompt not in self._expected:
            session_id = submit(prompt, self.args.max_tokens)
            if not ended(session_id, 300) or session_row(session_id)["status"] != "succeeded":
                raise SystemExit(f"the unfaulted run of {prompt!r} did not succeed: {session_row(session_id)}")
            self._expected[prompt] = Expected([token for _, token in token_rows(session_id)],
                                              session_row(session_id)["text"])
            say(f"unfaulted {prompt!r}: {len(self._expected[prompt].tokens)} tokens")
        return self._expected[prompt]

    def submit(self, prompt: str, sampled: bool, run: int) -> str:
        """A session of ``prompt`` (greedy, or sampled with the run's drafter), followed by a stream
        client from its first event."""
        drafter = SAMPLED_DRAFTERS[run % len(SAMPLED_DRAFTERS)] if sampled else "draft_model"
        session_id = submit(prompt, self.args.max_tokens, sampled=sampled, drafter=drafter)
        self.clients.follow(session_id)
        return session_id

    def record(self, kind: str, run: int, session_id: str, prompt: str, note: str, settle: float = 0.0,
               sampled: bool = False) -> None:
        result = outcome(session_id, None if sampled else self.expected(prompt), self.args.deadline,
                         self.args.max_tokens, settle, streamed=self.clients.streams[session_id], decode=self.decode)
        self.outcomes[kind].append(result)
        say(f"{kind} {run + 1}: {note}; {result.line()}")

    def kill(self, kind: str, run: int, sampled: bool) -> None:
        """One kill run (retried when the kill came after the session had ended)."""
        prompt = PROMPTS[run % len(PROMPTS)]
        expected = self.expected(prompt)
        for _attempt in range(ATTEMPTS):
            session_id = self.submit(prompt, sampled, run)
            if kind == "kill_worker":
                threshold = min(random.randint(5, 40), len(expected.tokens) // 3)
                wait(lambda sid=session_id, n=threshold: progressed(sid, n), 120)
                time.sleep(random.uniform(0.0, 0.25))
                at_kill = committed(session_id)
                worker = self.worker_of(session_id)
                if worker is None:
                    self.missed[kind] = self.missed.get(kind, 0) + 1
                    continue
                worker.kill_group()
            else:
                wait(lambda sid=session_id: session_row(sid)["status"] in ("running", *TERMINAL), 120)
                time.sleep(random.uniform(0.05, 1.5))
                at_kill = committed(session_id)
                worker = self.worker_of(session_id)
                if worker is None:
                    self.missed[kind] = self.missed.get(kind, 0) + 1
                    continue
                worker.kill_pid()
            status = session_row(session_id)["status"]
            self.workers[worker.role] = worker.again()
            if status in TERMINAL:  # the fault came too late to be one
                self.missed[kind] = self.missed.get(kind, 0) + 1
                continue
            self.record(kind, run, session_id, prompt, f"killed on {worker.role} at {at_kill} committed tokens",
                        sampled=sampled)
            return
        say(f"{kind} {run + 1}: every kill came after the session ended (generation too short?)")

    def broker_flush(self, run: int) -> None:
        import redis

        from sessions.streams import token_stream

        broker = redis.Redis.from_url(self.services.broker.url()) if self.services else token_stream.client()
        slots = self.args.concurrency * len(self.workers)  # one session more waits in the broker
        prompts = [PROMPTS[(run + offset) % len(PROMPTS)] for offset in range(slots + 1)]
        for prompt in prompts:
            self.expected(prompt)
        sampled = [offset % 2 == 1 for offset in range(len(prompts))]  # every other one
        ids = [self.submit(prompt, one_sampled, run) for prompt, one_sampled in zip(prompts, sampled)]
        wait(lambda: all(committed(session_id) >= 1 for session_id in ids[:-1]), 120)
        before = [(session_row(session_id)["status"], committed(session_id)) for session_id in ids]
        broker.flushdb()
        for prompt, session_id, one_sampled, (status, rows) in zip(prompts, ids, sampled, before):
            self.record("broker_flush", run, session_id, prompt, f"{status} with {rows} committed tokens at the flush",
                        sampled=one_sampled)

    def taken_over(self, session_id: str, attempts: int, timeout: float) -> bool:
        """Wait until another run claimed the session (or it ended)."""
        return bool(wait(lambda: (lambda row: row["attempts"] > attempts or row["status"] in TERMINAL)(
            session_row(session_id)), timeout, interval=0.1))

    def host_fault(self, kind: str, run: int, sampled: bool) -> None:
        """One pause, partition or restart run, once the session committed some tokens (retried
        when the session had ended first)."""
        prompt = PROMPTS[run % len(PROMPTS)]
        expected = self.expected(prompt)
        takeover_s = self.args.lease + self.args.requeue_after + 4 * self.args.reconcile_every + 30
        for _attempt in range(ATTEMPTS):
            session_id = self.submit(prompt, sampled, run)
            threshold = min(random.randint(3, 20), len(expected.tokens) // 3)
            wait(lambda sid=session_id, n=threshold: progressed(sid, n), 120)
            time.sleep(random.uniform(0.0, 0.2))
            row = session_row(session_id)
            worker = self.worker_of(session_id)
            if row["status"] != "running" or worker is None:
                self.missed[kind] = self.missed.get(kind, 0) + 1
                say(f"  {kind} {run + 1}: missed (status {row['status']}, worker {row['worker']!r}, "
                    f"{committed(session_id)} of {len(expected.tokens)} tokens committed)")
                continue
            at_fault, started = committed(session_id), time.monotonic()
            if kind == "pause":
                worker.pause()
                taken = self.taken_over(session_id, row["attempts"], takeover_s)
                time.sleep(random.uniform(0.0, 3.0))  # the new run gets on (or ends) before this one wakes
                worker.resume()
                note = f"{worker.role} paused {time.monotonic() - started:.1f} s at {at_fault} tokens, taken over: {taken}"
            elif kind == "partition":
                self.hosts.partition(worker.role)
                taken = self.taken_over(session_id, row["attempts"], takeover_s)
                time.sleep(random.uniform(0.0, 3.0))
                self.hosts.heal(worker.role)
                note = (f"{worker.role} cut off {time.monotonic() - started:.1f} s at {at_fault} tokens, "
                        f"taken over: {taken}")
            else:
                from sessions.runs import database_now

                service = getattr(self.services, kind.removeprefix("restart_"))
                # A session that had ended by the time the service was down was not hit (and a
                # Redis restart wipes the stream it wrote): on the database's clock, as finished_at.
                if kind == "restart_postgres":
                    down_at = database_now()
                    service.restart()
                else:
                    service.stop()
                    down_at = database_now()
                    service.start()
                finished_at = read(lambda sid=session_id: session_row(sid))["finished_at"]
                if finished_at is not None and finished_at <= down_at:
                    self.missed[kind] = self.missed.get(kind, 0) + 1
                    say(f"  {kind} {run + 1}: missed (the session ended {down_at - finished_at} before the "
                        f"service was down, {at_fault} of {len(expected.tokens)} tokens committed at the fault)")
                    continue
                note = f"restarted in {time.monotonic() - started:.1f} s at {at_fault} tokens on {worker.role}"
            # A woken run writes, if anything lets it, in its next step: give it a few leases' time.
            settle = 3 * self.args.lease if kind in ("pause", "partition") else 0.0
            self.record(kind, run, session_id, prompt, note, settle=settle, sampled=sampled)
            return
        say(f"{kind} {run + 1}: no attempt hit a running session (every fault came too late; see the lines above)")

    def revive(self) -> None:
        """Start again a worker that exited on its own, as the unit's ``Restart=on-failure`` does
        (a Redis broker's restart can end a worker: kombu's reconnection raises)."""
        for role, worker in list(self.workers.items()):
            if worker.process.poll() is not None:
                self.exited.append(f"{worker.node} (exit {worker.process.returncode})")
                say(f"  {worker.node} had exited (code {worker.process.returncode}; see {worker.log}): started again")
                self.workers[role] = worker.again()

    def run(self, case: str, run: int) -> None:
        if case == "broker_flush":  # its sessions are greedy and sampled
            self.revive()
            self.broker_flush(run)
            return
        for kind in KINDS:
            self.revive()
            if case in ("kill_child", "kill_worker"):
                self.kill(case, run, sampled=kind == "sampled")
            else:
                self.host_fault(case, run, sampled=kind == "sampled")

    def result_line(self) -> str:
        return result_line(self.outcomes)

    def stop(self) -> None:
        self.clients.stop()
        for worker in self.workers.values():
            worker.stop()


def parse_cases(value: str, hosts: str) -> list[str]:
    allowed = NETNS_CASES if hosts == "netns" else LOCAL_CASES
    cases = [case.strip() for case in value.split(",") if case.strip()] if value else list(allowed)
    unknown = [case for case in cases if case not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"--cases: {', '.join(unknown)} not among {', '.join(allowed)}"
                                         f" (with --hosts {hosts})")
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each fault")
    parser.add_argument("--hosts", choices=("local", "netns"), default="local",
                        help="local: one worker on this host and the shared services; netns: services and two "
                             "workers on network-namespace hosts of the bench's own (root)")
    parser.add_argument("--cases", default="", help="comma-separated faults to run (default: all of --hosts' "
                                                    f"cases: {', '.join(NETNS_CASES)} with netns)")
    parser.add_argument("--max-tokens", type=int, default=900,
                        help="per session (the tiny pair makes ~500 a second: shorter runs end before most faults)")
    parser.add_argument("--concurrency", type=int, default=2, help="task threads of the worker")
    parser.add_argument("--lease", type=float, default=3.0, help="SPECOPS_SESSION_LEASE_S")
    parser.add_argument("--requeue-after", type=float, default=10.0, help="SPECOPS_RECONCILE_QUEUED_S")
    parser.add_argument("--reconcile-every", type=float, default=1.0, help="seconds between reconciler passes")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds after a fault a session must end in")
    parser.add_argument("--torch-threads", type=int, default=1, help="OMP_NUM_THREADS of the worker")
    parser.add_argument("--admin-url", default=ADMIN_URL, help="with --hosts local")
    parser.add_argument("--redis-db", type=int, default=15, help="flushed: give the bench a database of its own")
    parser.add_argument("--database", default=BENCH_DB, help="recreated, and dropped unless --keep: one of its own")
    parser.add_argument("--seed", type=int, default=0, help="of the kill timings")
    parser.add_argument("--keep", action="store_true", help="keep the bench database (with --hosts local)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    try:
        cases = parse_cases(args.cases, args.hosts)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.hosts == "netns" and (why := netns_hosts.available()):
        parser.error(f"--hosts netns: {why}")
    random.seed(args.seed)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: still remove hosts and workers
    hosts = services = run_dir = None
    bench = None
    reconciler = None
    try:
        if args.hosts == "netns":
            hosts = netns_hosts.Hosts().create()
            run_dir = netns_hosts.run_directory(hosts.suffix)
            services = netns_hosts.Services.start(hosts, run_dir)
            args.admin_url = services.postgres.admin_url
            say(f"hosts: services at {hosts.services_ip} ({hosts.subnet}), workers on "
                f"{', '.join(hosts.WORKERS)}; namespaces specops-{hosts.suffix}-*; logs in {LOG_DIR}")
        bench_environment(args, services)
        recreate_database(args.admin_url, args.database)
        decode = prepare()
        started = time.monotonic()
        bench = FaultBench(args, decode, hosts, services, run_dir)
        reconciler = ReconcilerThread(args.reconcile_every)
        reconciler.start()
        for run in range(args.runs):
            for case in cases:
                bench.run(case, run)
        say(f"reconciler: {reconciler.passes}; faults that came too late (run again): {bench.missed}; "
            f"workers that exited on their own: {bench.exited or 'none'}; "
            f"{time.monotonic() - started:.0f} s; worker logs in {LOG_DIR}")
        say(bench.result_line())
    finally:
        if reconciler is not None:
            reconciler.stopped.set()
            reconciler.join(timeout=10)
        if bench is not None:
            bench.stop()
        from django.conf import settings
        from django.db import connections

        if settings.configured:  # prepare() ran
            connections.close_all()
        if hosts is not None:
            hosts.remove()
            if run_dir is not None:
                shutil.rmtree(run_dir, ignore_errors=True)
        elif args.hosts == "local" and not args.keep:
            drop_database(args.admin_url, args.database)


if __name__ == "__main__":
    main()
