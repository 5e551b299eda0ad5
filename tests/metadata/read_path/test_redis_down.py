"""Redis stopped in the middle of a burst: no errors, reads from the database, the cache back in
use after Redis restarts. The Redis stopped here is one this test starts on a port of its own."""
from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from django.db import connections

from metadata.cache import HITS, REDIS, CacheConfig, RedisGuard, TwoTierCache, fail_fast_client
from metadata.replicas import lsn
from sessions.state import load_session_state
from tests.metadata.read_path.conftest import make_session, wait_for_replica_catch_up, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


def free_port(first: int = 6390, last: int = 6399) -> int:
    for port in range(first, last + 1):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) != 0:
                return port
    raise RuntimeError(f"no free port in {first}-{last} for a private redis-server")


class PrivateRedis:
    """A redis-server of our own (never the shared one on 6379)."""

    def __init__(self, port: int, directory: Path) -> None:
        self.port = port
        self.directory = directory
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        assert wait_until(lambda: self._pings(client), 10), "private redis-server did not start"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None

    @staticmethod
    def _pings(client: redis.Redis) -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(free_port(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_redis_stopped_mid_burst_reads_fall_through_then_cache_resumes(private_redis, tenant, target_version):
    sessions = [make_session(tenant, target_version) for _ in range(5)]
    wait_for_replica_catch_up()
    guard = RedisGuard(lambda: fail_fast_client(f"redis://127.0.0.1:{private_redis.port}/0"), retry_s=0.2)
    cache = TwoTierCache("t_down", load_session_state, guard=guard, config=CacheConfig(local_ttl_s=0.05))
    stop = threading.Event()
    errors: list[BaseException] = []
    wrong: list[object] = []
    reads = [0]

    def reader() -> None:
        with lsn.floor_scope():
            while not stop.is_set():
                for session in sessions:
                    try:
                        value = cache.get(str(session.pk))
                        if value is None or value["id"] != session.pk:
                            wrong.append(value)
                        reads[0] += 1
                    except BaseException as exc:  # counted: the requirement is zero
                        errors.append(exc)
        connections.close_all()

    threads = [threading.Thread(target=reader) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        assert wait_until(lambda: cache.stats.total(REDIS, HITS) > 20, 10)  # the burst uses Redis

        private_redis.stop()
        loads_at_stop, reads_at_stop = cache.loads, reads[0]
        time.sleep(1.0)
        loads_while_down, reads_while_down = cache.loads - loads_at_stop, reads[0] - reads_at_stop

        redis_hits_at_restart = cache.stats.total(REDIS, HITS)
        private_redis.start()
        assert wait_until(lambda: cache.stats.total(REDIS, HITS) > redis_hits_at_restart + 20, 10)
        assert cache.bus.connected.wait(5)  # the invalidation listener reconnected too
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        cache.close()
        cache.bus.stop()

    assert errors == [] and wrong == []
    assert reads_while_down > 0 and loads_while_down > 0  # served, and served by the database
