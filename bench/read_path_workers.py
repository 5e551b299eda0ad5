"""The processes of bench/read_path.py (spawned: each sets Django up on its own)."""
from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

# "redis": plain Redis cache-aside; "two_tier_cold": two-tier with Redis emptied first.
MODES = ("off", "redis", "two_tier", "two_tier_cold")


def setup_django() -> None:
    import django

    django.setup()


@dataclass
class BurstReport:
    reads: int = 0
    errors: int = 0
    latencies_us: list[float] = field(default_factory=list)
    local_hit_latencies_us: list[float] = field(default_factory=list)  # reads the in-process tier served
    queries: dict[str, int] = field(default_factory=dict)  # database alias -> statements
    probe_queries: int = 0
    local: int = 0  # served in process: local hits and waits on another thread's load
    redis: int = 0  # served by Redis: hits and waits on another process's load
    loads: int = 0  # database loads


def install_query_counter() -> Counter:
    """Count every statement any Django connection of this process runs, per alias."""
    from django.db.backends.signals import connection_created

    counts: Counter = Counter()
    lock = threading.Lock()

    def count(execute, sql, params, many, context):
        with lock:
            counts[context["connection"].alias] += 1
        return execute(sql, params, many, context)

    def install(sender, connection, **kwargs) -> None:
        if count not in connection.execute_wrappers:
            connection.execute_wrappers.append(count)

    connection_created.connect(install, weak=False)
    return counts


def _warm_connections() -> None:
    from django.conf import settings
    from django.db import connections

    for alias in ["default", *settings.DATABASE_REPLICAS]:
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT 1")


def _reader(mode: str):
    from metadata import sessions as session_state

    if mode == "off":
        return None, lambda sid: session_state.load_session_state(sid).value
    two_tier = mode.startswith("two_tier")  # "redis": Redis only, with its cross-process lock only
    cache = session_state.build_state_cache(local=two_tier, coalesce=two_tier)
    return cache, cache.get


def burst_worker(mode, index, processes, threads, steps, branches, ids, barrier, results) -> None:
    try:
        setup_django()
        from django.db import connections

        from metadata.cache import COALESCED, HITS, LOCAL, REDIS
        from metadata.replicas import lsn, replica_health

        counts = install_query_counter()
        cache, read = _reader(mode)
        if cache is not None and cache.local_enabled:
            cache.bus.ensure_listening()
            cache.bus.connected.wait(5)
        report = BurstReport()
        slots = processes * threads
        ready = threading.Barrier(threads + 1)
        lock = threading.Lock()

        def run(slot: int) -> None:
            mine = [b for b in range(branches) if b % slots == slot]
            latencies: list[float] = []
            local_latencies: list[float] = []
            local_hits = (lambda: cache.stats.this_thread(LOCAL, HITS)) if cache is not None else (lambda: 0)
            errors = 0
            with lsn.floor_scope():
                _warm_connections()
                ready.wait()
                ready.wait()  # the start line, after the warm-up queries are forgotten
                for _ in range(steps):
                    for sid in ids:
                        for _ in mine:
                            hits_before = local_hits()
                            started = time.perf_counter_ns()
                            try:
                                value = read(sid)
                            except Exception:
                                errors += 1
                                continue
                            elapsed_us = (time.perf_counter_ns() - started) / 1000
                            latencies.append(elapsed_us)
                            if local_hits() > hits_before:
                                local_latencies.append(elapsed_us)
                            errors += value is None
            connections.close_all()
            with lock:
                report.latencies_us.extend(latencies)
                report.local_hit_latencies_us.extend(local_latencies)
                report.errors += errors

        pool = [threading.Thread(target=run, args=(index * threads + t,)) for t in range(threads)]
        for thread in pool:
            thread.start()
        ready.wait()
        counts.clear()
        probes_before = replica_health().probe_count
        barrier.wait(timeout=120)
        ready.wait()
        for thread in pool:
            thread.join()
        report.reads = len(report.latencies_us) + report.errors
        report.queries = dict(counts)
        report.probe_queries = (replica_health().probe_count - probes_before) * (1 + len(replica_health().aliases))
        if cache is None:
            report.loads = report.reads
        else:
            report.local = cache.stats.total(LOCAL, HITS) + cache.stats.total(LOCAL, COALESCED)
            report.redis = cache.stats.total(REDIS, HITS) + cache.stats.total(REDIS, COALESCED)
            report.loads = cache.loads
        results.put(report)
    except BaseException:
        results.put(traceback.format_exc())


def writer_process(ids, writes_per_s, stop, results) -> None:
    """What the generation workers do to session state meanwhile: update, then invalidate.
    Reports the database reads its write-through refreshes made (cache work, not write work)."""
    setup_django()
    from django.db.models import F
    from django.utils import timezone

    from metadata.models import Session
    from sessions.state import STATE, cache_for, invalidate_session

    pause = 1.0 / writes_per_s if writes_per_s > 0 else None
    while pause is not None and not stop.is_set():
        sid = random.choice(ids)
        Session.objects.filter(pk=sid).update(token_count=F("token_count") + 1, updated_at=timezone.now())
        invalidate_session(sid, regions=[STATE])
        stop.wait(pause)
    results.put(cache_for(STATE).loads)


def own_writes_worker(index, processes, ids, cycles, inbox, outbox, barrier, results) -> None:
    """Writers update their own sessions and read them back at once; the floor of each write goes
    to the next process, whose reader reads the session with it (what a client carrying the
    X-SpecOps-LSN header does). Returns (stale, checked)."""
    try:
        setup_django()
        from django.db import connections

        from metadata.models import Session
        from metadata.replicas import lsn
        from sessions.state import STATE, get_session_state, invalidate_session

        writers = 2
        mine = ids[index::processes]
        outcome = Counter()
        lock = threading.Lock()

        def tally(stale: bool) -> None:
            with lock:
                outcome["checked"] += 1
                outcome["stale"] += stale

        def write_and_read(slot: int) -> None:
            own = mine[slot::writers]
            with lsn.primary_only():
                expected = dict(Session.objects.filter(pk__in=own).values_list("pk", "token_count"))
            expected = {str(k): v for k, v in expected.items()}
            for cycle in range(cycles):
                sid = own[cycle % len(own)]
                expected[sid] += 1
                with lsn.floor_scope():
                    Session.objects.filter(pk=sid).update(token_count=expected[sid])
                    invalidate_session(sid, regions=[STATE])
                    tally(get_session_state(sid)["token_count"] < expected[sid])
                    outbox.put((sid, expected[sid], lsn.current().lsn))
            connections.close_all()

        def read_forwarded() -> None:
            while (item := inbox.get(timeout=120)) is not None:
                sid, value, floor = item
                with lsn.floor_scope(floor):
                    tally(get_session_state(sid)["token_count"] < value)
            connections.close_all()

        barrier.wait(timeout=120)
        pool = [threading.Thread(target=write_and_read, args=(slot,)) for slot in range(writers)]
        reader = threading.Thread(target=read_forwarded)
        for thread in [*pool, reader]:
            thread.start()
        for thread in pool:
            thread.join()
        outbox.put(None)
        reader.join()
        results.put((outcome["stale"], outcome["checked"]))
    except BaseException:
        results.put(traceback.format_exc())


def redis_down_worker(index, processes, threads, ids, down, up, stop, barrier, results) -> None:
    """Two-tier reads in a loop while the parent stops and restarts our private Redis."""
    try:
        setup_django()
        from django.db import connections

        from metadata.cache import HITS, REDIS
        from metadata.replicas import lsn
        from sessions.state import build_state_cache

        cache = build_state_cache()
        tally = Counter()
        lock = threading.Lock()

        def run() -> None:
            reads = errors = 0
            with lsn.floor_scope():
                while not stop.is_set():
                    for sid in ids:
                        try:
                            errors += cache.get(sid) is None
                        except Exception:
                            errors += 1
                        reads += 1
                        with lock:
                            tally["reads"] += 1
            connections.close_all()
            with lock:
                tally["errors"] += errors

        pool = [threading.Thread(target=run) for _ in range(threads)]
        barrier.wait(timeout=120)
        for thread in pool:
            thread.start()
        down.wait(60)
        loads_down, reads_down = cache.loads, tally["reads"]
        up.wait(60)
        loads_up, reads_up, hits_up = cache.loads, tally["reads"], cache.stats.total(REDIS, HITS)
        stop.wait(60)
        for thread in pool:
            thread.join()
        results.put({
            "reads": tally["reads"], "errors": tally["errors"], "reads_while_down": reads_up - reads_down,
            "loads_while_down": loads_up - loads_down,
            "redis_hits_after_restart": cache.stats.total(REDIS, HITS) - hits_up,
        })
    except BaseException:
        results.put(traceback.format_exc())


class PrivateRedis:
    """A redis-server of our own on a spare port (never the shared one on 6379)."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="specops-bench-redis-")
        self.port = self._free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @staticmethod
    def _free_port() -> int:
        for port in range(6390, 6400):
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) != 0:
                    return port
        raise SystemExit("no free port in 6390-6399 for a private redis-server")

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.directory], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.02)
        raise SystemExit(f"private redis-server on port {self.port} did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
