"""A streaming replica of the shared primary that belongs to one test process.

Tests that stop a replica or pause its replay do it to this one, never to the shared replica on
port 5433: replay is one process for the whole server, so pausing it (or stopping the server)
stalls every database's reads, those of every other test worker and of every other test run on
the machine. A stopped shared replica made other runs' read-path tests fail with "replica did not
catch up" and their replica pools back off for seconds after it came back.

It is a plain hot standby: ``pg_basebackup -R`` from the primary (a few seconds, test clusters
are small), its own data directory under /tmp, a free port, run as the ``postgres`` user and
ended by the kernel when the test process dies (``setpriv --pdeathsig``), so a killed run leaves
no server behind; its directory is removed at the end or, if the run was killed, by the next run.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from tests.web_process import free_port

PG_VERSION = "15"
PG_BIN = Path(f"/usr/lib/postgresql/{PG_VERSION}/bin")
DIR_PREFIX = "specops-test-replica-"
# A hot standby refuses to start with any of these below the primary's value.
COPIED_FROM_PRIMARY = ("max_connections", "max_worker_processes", "max_wal_senders",
                       "max_prepared_transactions", "max_locks_per_transaction")


def as_postgres(argv: list[str], die_with_this_process: bool = False) -> list[str]:
    """``argv`` run as the postgres user (the server refuses root); with the parent-death signal,
    the kernel sends SIGINT (a fast shutdown) when the thread that started it ends."""
    wrapper = ["setpriv", "--reuid", "postgres", "--regid", "postgres", "--init-groups"]
    if die_with_this_process:
        wrapper += ["--pdeathsig", "INT"]
    return [*wrapper, "--", *argv]


def remove_abandoned_directories() -> None:
    """Data directories of test processes that no longer exist (a killed run)."""
    for directory in Path(tempfile.gettempdir()).glob(f"{DIR_PREFIX}*"):
        try:
            owner = int(directory.name.removeprefix(DIR_PREFIX).split("-")[0])
        except ValueError:
            continue
        if not Path(f"/proc/{owner}").exists():
            shutil.rmtree(directory, ignore_errors=True)


@dataclass
class PrivateReplica:
    primary_host: str
    primary_port: int
    data_dir: Path
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @classmethod
    def build(cls, primary_host: str, primary_port: int) -> PrivateReplica:
        """Copy the primary (``pg_basebackup -R``: it starts as a standby) and start it."""
        remove_abandoned_directories()
        data_dir = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-"))
        shutil.chown(data_dir, "postgres", "postgres")
        replica = cls(primary_host, primary_port, data_dir)
        try:
            replica._copy_primary()
            replica._write_configuration()
            replica.start()
        except BaseException:
            replica.remove()
            raise
        return replica

    def _copy_primary(self) -> None:
        """``pg_basebackup -R``, one at a time on this machine, tried up to three times: two backups
        at once (two xdist workers) each force a checkpoint, and the checkpoint of one ended the
        other's WAL stream ("terminating process to release replication slot")."""
        command = as_postgres([str(PG_BIN / "pg_basebackup"), "-h", self.primary_host, "-p", str(self.primary_port),
                               "-U", "postgres", "-D", str(self.data_dir), "-R", "-X", "stream", "-c", "fast"])
        with open(Path(tempfile.gettempdir()) / f"{DIR_PREFIX}basebackup.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for attempt in range(3):
                out = subprocess.run(command, capture_output=True, text=True, timeout=300)
                if out.returncode == 0:
                    return
                for leftover in self.data_dir.iterdir():  # pg_basebackup wants an empty directory
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        raise AssertionError(f"pg_basebackup of {self.primary_host}:{self.primary_port} failed: {out.stderr}")

    def _admin(self, port: int, host: str | None = None) -> psycopg.Connection:
        return psycopg.connect(host=host or self.host, port=port, user="postgres", dbname="postgres",
                               autocommit=True, connect_timeout=3)

    def _write_configuration(self) -> None:
        """The data directory of a Debian cluster has no postgresql.conf or pg_hba.conf (they
        live in /etc): write this server's own. Durability is off: the copy is thrown away."""
        with self._admin(self.primary_port, self.primary_host) as primary:
            copied = {name: primary.execute(f"SHOW {name}").fetchone()[0] for name in COPIED_FROM_PRIMARY}
        lines = [f"listen_addresses = '{self.host}'", f"unix_socket_directories = '{self.data_dir}'",
                 "hot_standby = on", "fsync = off", "full_page_writes = off", "synchronous_commit = off",
                 *(f"{name} = {value}" for name, value in copied.items())]
        for name, text in (("postgresql.conf", "\n".join(lines)),
                           ("pg_hba.conf", "local all all trust\nhost all all 127.0.0.1/32 trust\n"),
                           ("pg_ident.conf", "")):
            path = self.data_dir / name
            path.write_text(text + "\n")
            shutil.chown(path, "postgres", "postgres")

    def start(self) -> None:
        """Start the server (on its last port, else a free one); return once it accepts connections."""
        assert self.process is None or self.process.poll() is not None, "already running"
        for attempt in range(3):  # a port can be taken meanwhile: then another one
            self.port = self.port if self.port and attempt == 0 else free_port()
            log = open(self.data_dir / "server.log", "a")  # noqa: SIM115 (the server writes it)
            self.process = subprocess.Popen(
                as_postgres([str(PG_BIN / "postgres"), "-D", str(self.data_dir), "-p", str(self.port)],
                            die_with_this_process=True),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self.process.poll() is None:
                if self.accepts_connections():
                    return
                time.sleep(0.1)
            self.stop()
        raise AssertionError(f"the private replica did not start; see {self.data_dir / 'server.log'}:\n"
                             + (self.data_dir / "server.log").read_text()[-3000:])

    def accepts_connections(self) -> bool:
        try:
            with self._admin(self.port) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    def stop(self) -> None:
        """A fast shutdown (SIGINT), as ``pg_ctl stop -m fast``."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
