"""Workers on other hosts, and the faults across them (issue 27), on network-namespace hosts.

``scripts/netns_hosts.py`` makes a services host (PostgreSQL, Redis, the broker: the test's own,
never the shared ones) and two worker hosts on a private subnet. The fast test checks the harness
itself: a worker host reaches the services over the subnet, a partition cuts it off, healing
brings it back, and nothing is left behind. The slow one runs ``bench/faults.py --hosts netns``
once per fault (a CPU worker on each worker host, the reconciler in the bench): a worker paused
past its lease, a worker host partitioned mid-generation and healed, a worker killed, PostgreSQL,
Redis and the broker restarted, each early in a generation that outlasts it (a PostgreSQL
restart during a session's final flush still fails it: bench/README.md, Faults), once on a
greedy session and once on a sampled one. Each session must end exactly once: succeeded, token
rows 0..n-1, no duplicate, no more than asked for, one ``done`` in its stream, what its stream
client was streamed a prefix of what it stores, and for a greedy one the unfaulted run's tokens
and text.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from scripts import netns_hosts
from tests.paths import REPO_ROOT

WHY_NOT = netns_hosts.available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"namespace hosts cannot be made here: {WHY_NOT}")

CASES = ("pause", "partition", "kill_worker", "restart_postgres", "restart_redis", "restart_broker")


def redis_ping(hosts: netns_hosts.Hosts, role: str, port: int) -> bool:
    argv = ["timeout", "2", "redis-cli", "-h", hosts.services_ip, "-p", str(port), "ping"]
    return subprocess.run(hosts.command(role, argv), capture_output=True, text=True).stdout.strip() == "PONG"


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def test_worker_hosts_reach_the_services_host_until_cut_off(tmp_path):
    with netns_hosts.Hosts() as hosts:
        redis = netns_hosts.Redis(hosts, netns_hosts.BROKER_PORT, tmp_path / "redis", tmp_path / "redis.log")
        names = {host.netns for host in hosts.hosts.values()}
        assert names <= set(re.findall(r"^(\S+)", namespaces(), re.M))
        hostname = subprocess.run(hosts.command("worker-a", ["hostname"]), capture_output=True, text=True)
        assert hostname.stdout.strip() == f"worker-a-{hosts.suffix}"  # a claim names the host
        assert redis_ping(hosts, "worker-a", redis.port) and redis_ping(hosts, "worker-b", redis.port)
        hosts.partition("worker-a")
        assert not redis_ping(hosts, "worker-a", redis.port)
        assert redis_ping(hosts, "worker-b", redis.port)  # only the one host is cut off
        hosts.heal("worker-a")
        assert redis_ping(hosts, "worker-a", redis.port)
        link = hosts.root_link
    assert redis.process.poll() is not None  # stopped with the hosts
    assert not names & set(re.findall(r"^(\S+)", namespaces(), re.M))
    assert subprocess.run(["ip", "link", "show", link], capture_output=True).returncode != 0


@pytest.mark.slow
def test_every_session_ends_once_through_pauses_partitions_kills_and_restarts():
    bench = subprocess.Popen(
        [sys.executable, "bench/faults.py", "--hosts", "netns", "--runs", "1", "--cases", ",".join(CASES),
         "--max-tokens", "900", "--lease", "2", "--requeue-after", "5", "--reconcile-every", "0.5",
         "--deadline", "90"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = bench.communicate(timeout=900)
    finally:
        if bench.poll() is None:  # SIGTERM: the bench removes its hosts, services and workers
            bench.terminate()
            bench.communicate(timeout=60)
    assert bench.returncode == 0, stdout[-3000:] + stderr[-3000:]
    lines = stdout.splitlines()
    for case in CASES:  # each fault hit a running session (not one that had ended) of each kind and it came through
        hit = [line for line in lines if line.startswith(f"{case} 1: ")]
        assert [kind for kind in ("greedy", "sampled") if any(f"; {kind} " in line for line in hit)] == [
            "greedy", "sampled"], hit
        for line in hit:
            assert "status=succeeded" in line and "rows_ok=True" in line and "text_ok=True" in line, line
            assert "stream_ok=True" in line, line
            if case in ("pause", "partition"):
                assert "taken over: True" in line, line  # past the lease: another run claimed the session
    result = dict(pair.split("=") for pair in lines[-1].removeprefix("RESULT ").split())
    assert result == {
        "kill_child_ok": "0/0", "kill_worker_ok": "2/2", "broker_flush_ok": "0/0", "duplicate_stream_events": "0",
        "lost_sessions": "0", "lost_rows": "0", "pause_ok": "2/2", "partition_ok": "2/2", "restart_ok": "6/6",
        "duplicate_tokens": "0", "over_max_tokens": "0", "text_mismatch": "0", "sampled_ok": "6/6",
        "stream_mismatch": "0"}, lines[-1]


ABANDONING_RUN = """
import os, signal, sys
from scripts import netns_hosts
hosts = netns_hosts.Hosts().create()
print(hosts.suffix, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no context manager, no atexit: the namespaces stay
"""


def test_the_next_run_removes_the_hosts_of_a_run_killed_outright():
    killed = subprocess.run([sys.executable, "-c", ABANDONING_RUN], cwd=REPO_ROOT, capture_output=True, text=True)
    suffix = killed.stdout.strip()
    assert killed.returncode == -9 and f"specops-{suffix}-services" in namespaces(), killed.stderr
    with netns_hosts.Hosts():
        assert f"specops-{suffix}-" not in namespaces()
        assert subprocess.run(["ip", "link", "show", f"sp{suffix}"], capture_output=True).returncode != 0
