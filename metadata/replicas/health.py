"""Where each replica stands: up or down, replayed WAL position, lag in bytes, probe latency.

Routing a read needs the replicas' positions, but asking a replica before every read would cost
a round trip per read. One thread per process probes (primary position first, then each
replica's ``pg_last_wal_replay_lsn()``) at most every ``SPECOPS_REPLICA_PROBE_TTL_S``; the others
keep using the last snapshot meanwhile instead of queueing behind the probe.

Probes use their own connections, not Django's pooled ones: a pool waits up to its timeout for a
connection to a replica that is down, and a probe must answer at once. Lag is measured in bytes
from LSNs, never as ``now() - pg_last_xact_replay_timestamp()`` (which grows while the primary is
idle).
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from django.conf import settings
from django.db import connections
from prometheus_client import Counter, Gauge

from metadata.conf import conf
from metadata.replicas.lsn import PRIMARY_ALIAS, parse_lsn

logger = logging.getLogger(__name__)

REPLICA_LAG_BYTES = Gauge(
    "specops_replica_lag_bytes", "WAL bytes the replica has not replayed yet (primary LSN - replay LSN).",
    ["replica"], multiprocess_mode="livemax",
)
REPLICA_UP = Gauge(
    "specops_replica_up", "1 if the replica answered its last probe within the thresholds, else 0.",
    ["replica"], multiprocess_mode="livemin",
)
REPLICA_PROBES = Counter("specops_replica_probes", "Replica position probes by outcome.", ["replica", "outcome"])


@dataclass(frozen=True, slots=True)
class ReplicaPosition:
    alias: str
    up: bool
    replay_lsn: int = 0
    lag_bytes: int | None = None
    probe_ms: float = 0.0
    error: str = ""


@dataclass(frozen=True, slots=True)
class HealthSnapshot:
    """``primary_lsn`` was read before the replicas were probed and before any read that uses this
    snapshot, so it is a lower bound of what such a read sees on the primary."""

    probed_at: float  # time.monotonic()
    primary_lsn: int
    replicas: tuple[ReplicaPosition, ...]


def _conninfo(alias: str, connect_timeout_s: float) -> dict[str, Any]:
    """Connection keywords for probing ``alias``'s server.

    Positions are per server, not per database, so the probe connects to the maintenance
    database (``SPECOPS_PROBE_DATABASE``, "postgres" like Django's own maintenance connections):
    a long-lived probe session on the application database would block ``DROP DATABASE`` (test
    teardown, restores).
    """
    config = connections[alias].settings_dict
    params = {
        "dbname": conf.PROBE_DATABASE,
        "connect_timeout": max(1, round(connect_timeout_s)), "autocommit": True,
        "application_name": "specops-replica-probe",
    }
    for key, name in (("USER", "user"), ("PASSWORD", "password"), ("HOST", "host"), ("PORT", "port")):
        if config.get(key):
            params[name] = config[key]
    return params


class ReplicaHealth:
    """Cached replica positions of one process; thread-safe and fork-aware."""

    def __init__(
        self, aliases: list[str], ttl_s: float = 0.5, max_lag_bytes: int = 16 << 20,
        max_probe_ms: float = 100.0, connect_timeout_s: float = 1.0,
    ) -> None:
        self.aliases = list(aliases)
        self.ttl_s = ttl_s
        self.max_lag_bytes = max_lag_bytes
        self.max_probe_ms = max_probe_ms
        self.connect_timeout_s = connect_timeout_s
        self.probe_count = 0
        self._snapshot: HealthSnapshot | None = None
        self._probe_lock = threading.Lock()
        self._round_robin = itertools.count()
        self._marked_down: dict[str, float] = {}  # alias -> monotonic deadline
        self._conns: dict[str, psycopg.Connection] = {}
        self._inherited: list[psycopg.Connection] = []
        self._pid = os.getpid()
        # A fork while another thread probes would leave the child's lock held forever.
        os.register_at_fork(after_in_child=self._reset_lock_after_fork)

    def _reset_lock_after_fork(self) -> None:
        self._probe_lock = threading.Lock()

    # ------------------------------------------------------------------ reading the snapshot
    def snapshot(self) -> HealthSnapshot:
        """The last snapshot if younger than the TTL, else a fresh probe (one thread probes)."""
        current = self._snapshot
        if current is not None and time.monotonic() - current.probed_at < self.ttl_s and self._pid == os.getpid():
            return current
        # Nobody waits for a probe in progress if there is a snapshot to use meanwhile.
        if not self._probe_lock.acquire(blocking=current is None):
            return current
        try:
            current = self._snapshot
            if current is None or time.monotonic() - current.probed_at >= self.ttl_s or self._pid != os.getpid():
                self._snapshot = current = self._probe()
            return current
        finally:
            self._probe_lock.release()

    def pick(self, min_lsn: int) -> ReplicaPosition | None:
        """A usable replica that has replayed ``min_lsn``, or None (read from the primary)."""
        eligible = [r for r in self.snapshot().replicas if self.usable(r) and r.replay_lsn >= min_lsn]
        if not eligible:
            return None
        return eligible[next(self._round_robin) % len(eligible)]

    def usable(self, position: ReplicaPosition) -> bool:
        return (
            position.up and position.probe_ms <= self.max_probe_ms
            and (position.lag_bytes is None or position.lag_bytes <= self.max_lag_bytes)
            and self._marked_down.get(position.alias, 0.0) <= time.monotonic()
        )

    def mark_down(self, alias: str, reason: str) -> None:
        """Skip ``alias`` for one probe interval: a query on it just failed.

        A deadline rather than an edit of the snapshot, so a probe that was already running when
        the replica failed cannot bring it back at once.
        """
        self._marked_down[alias] = time.monotonic() + self.ttl_s
        REPLICA_UP.labels(alias).set(0)
        logger.warning("replica %s skipped for %.1f s: %s", alias, self.ttl_s, reason)

    def expire(self) -> None:
        """Forget the snapshot and the down marks so the next read probes again (tests)."""
        with self._probe_lock:
            self._snapshot = None
            self._marked_down.clear()

    # ------------------------------------------------------------------ probing
    def _probe(self) -> HealthSnapshot:
        self._forget_inherited_connections()
        self.probe_count += 1
        primary_lsn = self._primary_lsn()
        replicas = tuple(self._probe_replica(alias, primary_lsn) for alias in self.aliases)
        return HealthSnapshot(time.monotonic(), primary_lsn, replicas)

    def _primary_lsn(self) -> int:
        try:
            return parse_lsn(self._query(PRIMARY_ALIAS, "SELECT pg_current_wal_insert_lsn()::text"))
        except psycopg.Error as exc:
            # No primary position: no replica can be proven fresh, so lag is unknown (None) and
            # only callers without a floor may use a replica.
            logger.warning("primary position probe failed: %s", exc)
            return 0

    def _probe_replica(self, alias: str, primary_lsn: int) -> ReplicaPosition:
        try:
            text, probe_ms = self._timed_query(alias, "SELECT pg_last_wal_replay_lsn()::text")
        except psycopg.Error as exc:
            REPLICA_UP.labels(alias).set(0)
            REPLICA_PROBES.labels(alias, "down").inc()
            return ReplicaPosition(alias, up=False, error=str(exc).strip().splitlines()[0] if str(exc) else "error")
        if text is None:  # not a standby (promoted, or misconfigured): never route reads to it
            REPLICA_UP.labels(alias).set(0)
            REPLICA_PROBES.labels(alias, "not_in_recovery").inc()
            return ReplicaPosition(alias, up=False, probe_ms=probe_ms, error="not in recovery")
        replay_lsn = parse_lsn(text)
        lag = max(0, primary_lsn - replay_lsn) if primary_lsn else None
        position = ReplicaPosition(alias, up=True, replay_lsn=replay_lsn, lag_bytes=lag, probe_ms=probe_ms)
        if lag is not None:
            REPLICA_LAG_BYTES.labels(alias).set(lag)
        REPLICA_UP.labels(alias).set(1 if self.usable(position) else 0)
        REPLICA_PROBES.labels(alias, "up").inc()
        return position

    def _query(self, alias: str, sql: str) -> str | None:
        return self._timed_query(alias, sql)[0]

    def _timed_query(self, alias: str, sql: str) -> tuple[str | None, float]:
        """(first column, milliseconds of the query alone: a reconnect is not the replica's latency)."""
        conn = self._conns.get(alias)
        try:
            if conn is None or conn.closed:
                conn = self._conns[alias] = psycopg.connect(**_conninfo(alias, self.connect_timeout_s))
            started = time.perf_counter()
            row = conn.execute(sql).fetchone()
            return (row[0] if row else None), (time.perf_counter() - started) * 1000
        except psycopg.Error:
            self._drop(alias)
            raise

    def _drop(self, alias: str) -> None:
        conn = self._conns.pop(alias, None)
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass

    def _forget_inherited_connections(self) -> None:
        """After a fork, leave the parent's sockets alone: closing them would end the parent's
        sessions. Keep references so they are never finalised in the child."""
        if self._pid != os.getpid():
            self._inherited.extend(self._conns.values())
            self._conns = {}
            self._pid = os.getpid()

    def close(self) -> None:
        with self._probe_lock:
            for alias in list(self._conns):
                self._drop(alias)
            self._snapshot = None


_default: ReplicaHealth | None = None
_default_lock = threading.Lock()


def replica_health() -> ReplicaHealth:
    """The process-wide instance, built from settings on first use."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = ReplicaHealth(
                    list(settings.DATABASE_REPLICAS),
                    ttl_s=conf.REPLICA_PROBE_TTL_S,
                    max_lag_bytes=conf.REPLICA_MAX_LAG_BYTES,
                    max_probe_ms=conf.REPLICA_MAX_PROBE_MS,
                )
    return _default
