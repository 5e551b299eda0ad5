"""Hosts made of network namespaces: a services host and two worker hosts on a private subnet.

What a multi-host deployment looks like, on one machine (issue 27): PostgreSQL, Redis and the
broker on one host, CPU workers on two others that reach them over the network and load models
from their own disks. Each host is a network namespace (``ip netns``) with its own hostname (a
UTS namespace per process, so a claim's ``worker`` column names the host). The services host holds
a bridge, the subnet's switch; every other host has a veth pair into it, the machine's own
namespace too (where the caller, playing the web host, reaches the services at
``services_ip``). Cutting a worker host off is its bridge port going down; healing, up again.

The services are the caller's own, started inside the services namespace from nothing (an
``initdb`` into a temporary directory, two ``redis-server``: the cache and streams, and the
broker), never the machine's shared ones, so that restarting them hurts nobody else. Names carry
a per-run suffix and the subnet is one no other run uses (chosen under a lock), so parallel runs
never collide; everything is removed at the end, also when the run fails (a context manager, and
``atexit`` for an exit that skips it). A run killed outright (SIGKILL) leaves its namespaces;
the next run removes them, and the processes in them, once their owner's pid is gone (each run
records its pid under ``OWNERS``).

Needs root and iproute2. Written by hand over ``ip`` (no library manages namespaces, veths and
bridges together in a few lines; pyroute2 would be a new dependency for the same commands).
"""
from __future__ import annotations

import atexit
import fcntl
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNETS = ipaddress.ip_network("10.201.0.0/16")  # one /24 of it per run
PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_PORT, REDIS_PORT, BROKER_PORT = 5432, 6379, 6380  # inside the services namespace: nobody else's
LOCK = Path("/tmp/specops-netns-hosts.lock")
OWNERS = Path("/tmp/specops-netns-hosts")  # <suffix>.pid: the pid of the run that made the hosts


def available() -> str | None:
    """Why hosts cannot be made here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "unshare", "redis-server", "runuser"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    if not (PG_BIN / "initdb").is_file():
        return f"no PostgreSQL server binaries in {PG_BIN}"
    return None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def stop(process: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """Signal a process started in a session of its own (its group), SIGKILL after ``timeout``."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGCONT)  # a paused process cannot exit
        os.killpg(process.pid, sig)
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        process.wait()


def wait_until(probe, timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


@dataclass
class Host:
    """One namespace: its name (``ip netns``), hostname, address and bridge port."""

    role: str
    netns: str
    address: str
    port: str  # its veth end on the services host's bridge (down = cut off)


@dataclass
class Hosts:
    """The namespaces and links of one run: ``services``, ``worker-a`` and ``worker-b``."""

    suffix: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: ipaddress.IPv4Network | None = None
    hosts: dict[str, Host] = field(default_factory=dict)
    root_link: str = ""
    processes: list[subprocess.Popen] = field(default_factory=list)

    WORKERS = ("worker-a", "worker-b")

    @property
    def services_ip(self) -> str:
        return str(self.subnet[1])

    def create(self) -> Hosts:
        atexit.register(self.remove)
        with LOCK.open("w") as lock:  # two runs choosing a subnet at once would choose the same
            fcntl.flock(lock, fcntl.LOCK_EX)
            sweep_abandoned()
            OWNERS.mkdir(exist_ok=True)
            (OWNERS / f"{self.suffix}.pid").write_text(str(os.getpid()))
            self.subnet = self._free_subnet()
            prefix = self.subnet.prefixlen
            services = self._add_namespace("services", str(self.subnet[1]), port="")
            ip("-n", services.netns, "link", "add", "br0", "type", "bridge")
            ip("-n", services.netns, "addr", "add", f"{services.address}/{prefix}", "dev", "br0")
            ip("-n", services.netns, "link", "set", "br0", "up")
            for index, role in enumerate(self.WORKERS):
                host = self._add_namespace(role, str(self.subnet[2 + index]), port=f"port-{role}")
                ip("-n", host.netns, "link", "add", "eth0", "type", "veth", "peer", "name", host.port,
                   "netns", services.netns)
                self._plug(host, "eth0", host.netns)
            # The machine's own namespace (the web host: the caller) on the same switch.
            self.root_link = f"sp{self.suffix}"
            ip("link", "add", self.root_link, "type", "veth", "peer", "name", "port-web", "netns", services.netns)
            ip("addr", "add", f"{self.subnet[254]}/{prefix}", "dev", self.root_link)
            ip("link", "set", self.root_link, "up")
            self._bridge("port-web")
        return self

    def _free_subnet(self) -> ipaddress.IPv4Network:
        routes = subprocess.run(["ip", "-4", "route", "show"], check=True, capture_output=True, text=True).stdout
        used = {line.split()[0] for line in routes.splitlines()}
        for subnet in SUBNETS.subnets(new_prefix=24):
            if str(subnet) not in used and subnet.network_address.packed[2] != 0:
                return subnet
        raise RuntimeError(f"every /24 of {SUBNETS} is in use")

    def _add_namespace(self, role: str, address: str, port: str) -> Host:
        netns = f"specops-{self.suffix}-{role}"
        ip("netns", "add", netns)
        self.hosts[role] = Host(role, netns, address, port)
        ip("-n", netns, "link", "set", "lo", "up")
        return self.hosts[role]

    def _plug(self, host: Host, device: str, netns: str) -> None:
        ip("-n", netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", device)
        ip("-n", netns, "link", "set", device, "up")
        self._bridge(host.port)

    def _bridge(self, port: str) -> None:
        services = self.hosts["services"].netns
        ip("-n", services, "link", "set", port, "master", "br0")
        ip("-n", services, "link", "set", port, "up")

    # ------------------------------------------------------------------ processes on a host
    def command(self, role: str, argv: list[str], user: str | None = None) -> list[str]:
        """``argv`` run on host ``role``: in its network namespace, under its own hostname."""
        host = self.hosts[role]
        run_as = ["runuser", "-u", user, "--"] if user else []
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                f"{role}-{self.suffix}", *run_as, *argv]

    def start(self, role: str, argv: list[str], log: Path, env: dict | None = None, user: str | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        """Start ``argv`` on host ``role`` in a session of its own (its pid is ``argv``'s: every
        wrapper execs), output to ``log``."""
        process = subprocess.Popen(self.command(role, argv, user), env=env, cwd=cwd, stdout=log.open("w"),
                                   stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(process)
        return process

    def partition(self, role: str) -> None:
        """Cut host ``role`` off the network (its port on the switch goes down)."""
        ip("-n", self.hosts["services"].netns, "link", "set", self.hosts[role].port, "down")

    def heal(self, role: str) -> None:
        ip("-n", self.hosts["services"].netns, "link", "set", self.hosts[role].port, "up")

    def remove(self) -> None:
        """Stop every process started here and delete the namespaces (their links go with them)."""
        for process in self.processes:
            stop(process, signal.SIGKILL, timeout=10)
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        if self.root_link:
            subprocess.run(["ip", "link", "del", self.root_link], capture_output=True)
        (OWNERS / f"{self.suffix}.pid").unlink(missing_ok=True)
        self.hosts.clear()
        self.root_link = ""

    def __enter__(self) -> Hosts:
        return self.create()

    def __exit__(self, *exc_info) -> None:
        self.remove()


def sweep_abandoned() -> None:
    """Remove the namespaces of runs whose process is gone (killed before it could remove them),
    with every process still in them and their link in this namespace."""
    for record in OWNERS.glob("*.pid") if OWNERS.is_dir() else ():
        try:
            os.kill(int(record.read_text() or 0), 0)
            continue  # its run is alive
        except (ProcessLookupError, ValueError):
            pass
        suffix = record.stem
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        for netns in (name for name in listed if name.startswith(f"specops-{suffix}-")):
            pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        subprocess.run(["ip", "link", "del", f"sp{suffix}"], capture_output=True)
        record.unlink(missing_ok=True)


# ---------------------------------------------------------------------- services of the run's own
class Postgres:
    """A PostgreSQL server of the run's own on the services host: ``initdb`` into ``data`` (as the
    postgres user, as ``scripts/services.sh``'s clusters run), trust for the subnet, durability
    off (a test's data). ``restart`` is a fast shutdown and a start, as ``pg_ctl restart``."""

    def __init__(self, hosts: Hosts, data: Path, log: Path) -> None:
        self.hosts, self.data, self.log = hosts, data, log
        self.process: subprocess.Popen | None = None
        data.mkdir(parents=True)
        shutil.chown(data, "postgres", "postgres")
        subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres",
                        "-A", "trust", "--no-sync"], check=True, capture_output=True)
        with (data / "postgresql.conf").open("a") as conf:
            conf.write(f"\nlisten_addresses = '*'\nport = {PG_PORT}\nunix_socket_directories = '{data}'\n"
                       "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 200\n")
        with (data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {hosts.subnet} trust\n")
        self.start()

    @property
    def admin_url(self) -> str:
        return f"postgres://postgres@{self.hosts.services_ip}:{PG_PORT}/postgres"

    def url(self, database: str) -> str:
        return f"postgres://postgres@{self.hosts.services_ip}:{PG_PORT}/{database}"

    def start(self) -> None:
        self.process = self.hosts.start("services", [str(PG_BIN / "postgres"), "-D", str(self.data)], self.log,
                                        user="postgres")
        ready = [str(PG_BIN / "pg_isready"), "-q", "-h", self.hosts.services_ip, "-p", str(PG_PORT)]
        wait_until(lambda: subprocess.run(ready).returncode == 0, 60, "postgres on the services host")

    def stop(self) -> None:
        stop(self.process, signal.SIGINT)  # fast shutdown: connections are cut, as a restart does

    def restart(self) -> None:
        self.stop()
        self.start()


class Redis:
    """A ``redis-server`` of the run's own on the services host (no persistence: a restart loses
    everything, the harder case)."""

    def __init__(self, hosts: Hosts, port: int, workdir: Path, log: Path) -> None:
        self.hosts, self.port, self.workdir, self.log = hosts, port, workdir, log
        self.process: subprocess.Popen | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        self.start()

    def url(self, db: int = 0) -> str:
        return f"redis://{self.hosts.services_ip}:{self.port}/{db}"

    def start(self) -> None:
        self.process = self.hosts.start("services", [
            "redis-server", "--port", str(self.port), "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "",
            "--appendonly", "no", "--dir", str(self.workdir)], self.log)
        ping = ["redis-cli", "-h", self.hosts.services_ip, "-p", str(self.port), "ping"]
        wait_until(lambda: subprocess.run(ping, capture_output=True, text=True).stdout.strip() == "PONG", 30,
                   f"redis on the services host, port {self.port}")

    def stop(self) -> None:
        stop(self.process, signal.SIGTERM)

    def restart(self) -> None:
        self.stop()
        self.start()


@dataclass
class Services:
    """PostgreSQL, Redis (cache and streams) and the broker (a second Redis) on the services host."""

    postgres: Postgres
    redis: Redis
    broker: Redis

    @classmethod
    def start(cls, hosts: Hosts, workdir: Path) -> Services:
        return cls(Postgres(hosts, workdir / "pgdata", workdir / "postgres.log"),
                   Redis(hosts, REDIS_PORT, workdir / "redis", workdir / "redis.log"),
                   Redis(hosts, BROKER_PORT, workdir / "broker", workdir / "broker.log"))


def run_directory(suffix: str) -> Path:
    """A temporary directory the postgres user can enter (its data directory lies below)."""
    path = Path(tempfile.mkdtemp(prefix=f"specops-hosts-{suffix}-"))
    path.chmod(0o755)
    return path
