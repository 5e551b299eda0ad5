"""Conversation affinity: a request whose prompt extends a recent one goes to the worker holding it.

Each device's prefix cache (inference/engine/kv/prefix_cache.py) lives in one worker process, so
the next turn of a chat only hits it when it runs on the same device. With several workers on
one device queue (several hosts, or several GPUs serving one model), SpecOps routes by prefix:

* a worker that ends a session records the chain hashes of its context's whole blocks (prompt
  and reply, the prefix cache's block size) in Redis, each naming the worker's Celery node, for
  `RECORD_TTL_S`;
* the web, enqueueing a session, hashes its prompt's blocks the same way, asks Redis for all of
  them in one MGET and takes the deepest block recorded; when that node is alive (its heartbeat,
  refreshed by its batching loop every `HEARTBEAT_EVERY_S`) and not full, the task goes to the
  node's own queue (Celery's ``worker_direct``: every worker also consumes ``<node>.dq2``);
  otherwise to the model's device queue as before.

Routing is scoped like the prefix cache itself: a chain starts from the model version and the
request's prefix cache scope (its tenant, or its tenant's group: ``Tenant.prefix_cache_scope``),
so a tenant's request is never routed by, and never learns of, blocks another tenant recorded.

A node that dies after a task was routed to it leaves the task in its direct queue; the
reconciler re-enqueues a session queued past ``SPECOPS_RECONCILE_QUEUED_S`` on the model's device
queue (``Session.queue``), so routing never loses a session, it can only delay one. The hashes are
blake2b chains (a block's hash covers every token before it), so they agree across processes.
Redis errors never fail a request: it is then routed as without affinity.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence

from django_redis import get_redis_connection

from inference.conf import conf

logger = logging.getLogger(__name__)

RECORD_PREFIX = "specops:affinity:block:"
NODE_PREFIX = "specops:affinity:node:"
RECORD_TTL_S = 1800  # a conversation idle longer than this is routed as a new one
HEARTBEAT_EVERY_S = 5.0
HEARTBEAT_TTL_S = 20
MAX_BLOCKS = 256  # hashes recorded and looked up per context (the first ones: they carry the prefix)

_node: str | None = None  # this worker's Celery node name (set when the worker starts)
_last_heartbeat = 0.0


def set_node(name: str | None) -> None:
    """This process's Celery node name (``celeryd_after_setup``); None outside a worker."""
    global _node
    _node = name


def enabled() -> bool:
    return conf.PREFIX_AFFINITY and conf.PREFIX_CACHE_MB > 0


def block_hashes(version_id: int, scope: str, token_ids: Sequence[int], block: int | None = None) -> list[str]:
    """The chain hash of each whole block of `token_ids` (at most MAX_BLOCKS), for one model version
    and one prefix cache scope (the chain of another scope shares no hash with it)."""
    block = block or conf.PREFIX_CACHE_BLOCK
    digest = hashlib.blake2b(f"v{version_id}\x00{scope}".encode(), digest_size=16).digest()
    out = []
    for start in range(0, min(len(token_ids), MAX_BLOCKS * block) - block + 1, block):
        chunk = ",".join(str(token) for token in token_ids[start:start + block]).encode()
        digest = hashlib.blake2b(digest + chunk, digest_size=16).digest()
        out.append(digest.hex())
    return out


def record(version_id: int, scope: str, token_ids: Sequence[int]) -> None:
    """Worker: the blocks of a context this node's prefix cache now holds for `scope` (one pipelined write)."""
    if _node is None or not enabled():
        return
    hashes = block_hashes(version_id, scope, token_ids)
    if not hashes:
        return
    try:
        pipe = get_redis_connection("default").pipeline(transaction=False)
        for digest in hashes:
            pipe.set(RECORD_PREFIX + digest, _node, ex=RECORD_TTL_S)
        pipe.execute()
    except Exception:
        logger.warning("affinity: blocks of a finished session not recorded", exc_info=True)


def heartbeat(running: int, capacity: int) -> None:
    """Worker's batching loop: this node is alive, with `running` of `capacity` rows busy (throttled)."""
    global _last_heartbeat
    if _node is None or not enabled():
        return
    now = time.monotonic()
    if now - _last_heartbeat < HEARTBEAT_EVERY_S:
        return
    _last_heartbeat = now
    try:
        get_redis_connection("default").set(NODE_PREFIX + _node, json.dumps({"running": running, "capacity": capacity}),
                                            ex=HEARTBEAT_TTL_S)
    except Exception:
        logger.warning("affinity: heartbeat not written", exc_info=True)


def holder(version_id: int, scope: str, token_ids: Sequence[int]) -> str | None:
    """Web: the live, not full node that recorded the deepest block of `token_ids` in `scope`, or None."""
    if not enabled():
        return None
    hashes = block_hashes(version_id, scope, token_ids)
    if not hashes:
        return None
    try:
        connection = get_redis_connection("default")
        nodes = connection.mget([RECORD_PREFIX + digest for digest in hashes])
        node = next((value for value in reversed(nodes) if value is not None), None)
        if node is None:
            return None
        node = node.decode() if isinstance(node, bytes) else node
        alive = connection.get(NODE_PREFIX + node)
    except Exception:
        logger.warning("affinity: lookup failed; routed without it", exc_info=True)
        return None
    if alive is None:
        return None
    load = json.loads(alive)
    return node if load["running"] < load["capacity"] else None


def route_session(session, tenant) -> str | None:
    """Submission's router (``sessions.submission.route_with``, registered by ``InferenceConfig.ready``):
    the direct queue of the node holding the longest recorded prefix of the session's prompt in its
    tenant's scope, or None (the model's device queue)."""
    return route(session.target, session.prompt, tenant.prefix_cache_scope())


def route(target, prompt: str, scope: str):
    """Web: the queue for a new session of `target` (a ModelVersion) with `prompt` in prefix cache
    `scope`: the direct queue of the node holding its longest prefix recorded in that scope, or
    None (the model's device queue)."""
    if not enabled():
        return None
    from celery.utils.nodenames import worker_direct

    from inference.tokenizers import tokenizer_for

    try:
        node = holder(target.pk, scope, tokenizer_for(str(target.directory))(prompt)["input_ids"])
    except Exception:  # routing is an optimisation: it never fails an enqueue
        logger.warning("affinity: routing failed; the device queue takes it", exc_info=True)
        return None
    return worker_direct(node) if node is not None else None
