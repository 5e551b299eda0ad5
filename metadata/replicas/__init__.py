"""Primary/replica routing with read-your-writes.

A caller's floor (``lsn``: the primary WAL position its own writes reached) travels in a
contextvar and, between requests, in the ``X-SpecOps-LSN`` header (``ReadYourWritesMiddleware``).
``ReplicaRouter`` and ``route_read`` send a read to a replica only if it has replayed that floor
and is within the lag and latency thresholds that ``replica_health`` probes; ``read_routed`` runs a
read there and retries on the primary when the replica fails mid-read.

Modules: ``lsn`` (floors, positions, the write marker), ``health`` (probes), ``router`` (routing),
``fallback`` (retry on the primary), ``middleware`` (the per-request floor).
"""
from __future__ import annotations

from metadata.replicas import lsn
from metadata.replicas.fallback import REPLICA_ERRORS, abandon_replica, read_routed, replicas_used
from metadata.replicas.health import HealthSnapshot, ReplicaHealth, ReplicaPosition, replica_health
from metadata.replicas.middleware import ReadYourWritesMiddleware, client_floor
from metadata.replicas.router import ReadRoute, ReplicaRouter, primary_route, route_read

__all__ = [
    "REPLICA_ERRORS", "HealthSnapshot", "ReadRoute", "ReadYourWritesMiddleware", "ReplicaHealth",
    "ReplicaPosition", "ReplicaRouter", "abandon_replica", "client_floor", "lsn", "primary_route",
    "read_routed", "replica_health", "replicas_used", "route_read",
]
