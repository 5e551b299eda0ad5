"""A session's state and detail, read through the two-tier cache, and kept true by the package's own writes.

Two regions per session, cached under separate keys so a write can invalidate just one:

* ``state`` (id, tenant, status, token_count, updated_at): what speculative branches and pollers
  read over and over. One index-only scan of ``session_state_covering``. Write-through: a write
  reloads it from the primary right after commit and stores it in Redis, so the next burst starts
  warm in every process (cache-aside left Redis empty after each write, and every process's first
  read of the session went to PostgreSQL). The reload is one primary read per session and
  commit, on the writer's thread: the worker writes progress at most every
  ``SPECOPS_PROGRESS_MS`` (one transaction for all its sessions), off the batching loop.
* ``detail``: the whole row with its target model, for ``GET /api/v1/sessions/{id}/``.
  Cache-aside: read far less often, and its ``text`` is the large part.

Who invalidates: the writes of this package (the claim, progress, the end, cancel, a re-queue)
call ``invalidate_session`` / ``invalidate_sessions`` after their ``UPDATE``; ``save()`` and
``delete()`` of a ``Session`` anywhere are covered by the signal receivers below. Nothing outside
the package calls them (``tests/test_session_home.py`` checks it).
"""
from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable
from typing import Any

from django.db import connections, transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from metadata.cache import CacheConfig, RedisGuard, TwoTierCache, ValueCodec, Versioned, WritePolicy
from metadata.cache.rows import instance_of, row_of
from metadata.ids import created_at_of
from metadata.models import ModelVersion, Session
from metadata.replicas import lsn, read_routed

logger = logging.getLogger(__name__)

STATE = "state"
DETAIL = "detail"
REGIONS = (STATE, DETAIL)
STATE_FIELDS = ("id", "tenant_id", "status", "token_count", "updated_at")

_STATE_SQL = (
    f"SELECT {', '.join(STATE_FIELDS)} FROM {Session._meta.db_table} WHERE id = %s"  # noqa: S608 (constants)
)
# A UUIDv7 id carries its partition key: the same read, pruned to one partition.
_STATE_SQL_PRUNED = _STATE_SQL + " AND created_at = %s"


def load_session_state(ident: str, min_lsn: int = 0) -> Versioned:
    """Read the state row where the router says (a replica that has replayed ``min_lsn``)."""
    created_at = created_at_of(ident)
    sql, params = (_STATE_SQL, [ident]) if created_at is None else (_STATE_SQL_PRUNED, [ident, created_at])

    def read(alias: str) -> dict[str, Any] | None:
        with connections[alias].cursor() as cursor:
            cursor.execute(sql, params)
            row = cursor.fetchone()
        return dict(zip(STATE_FIELDS, row)) if row is not None else None

    value, route = read_routed(read, min_lsn)
    return Versioned(value, route.source_lsn)


def load_session_states(idents: list[str], min_lsn: int = 0) -> dict[str, Versioned]:
    """`load_session_state` of several sessions in one read (a session not found is left out);
    UUIDv7 ids read only the partitions their times name."""
    times = [created_at_of(ident) for ident in idents]
    sql = f"SELECT {', '.join(STATE_FIELDS)} FROM {Session._meta.db_table} WHERE id = ANY(%s::uuid[])"  # noqa: S608
    params: list[Any] = [list(idents)]
    if all(when is not None for when in times):
        sql += " AND created_at = ANY(%s::timestamptz[])"
        params.append(sorted(set(times)))

    def read(alias: str) -> list[tuple]:
        with connections[alias].cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchall()

    rows, route = read_routed(read, min_lsn)
    return {str(row[0]): Versioned(dict(zip(STATE_FIELDS, row)), route.source_lsn) for row in rows}


def load_session_detail(ident: str, min_lsn: int = 0) -> Versioned:
    """Read the session row and its target model where the router says."""
    def read(alias: str) -> Session | None:
        return Session.objects.using(alias).select_related("target").filter(pk=ident).first()

    value, route = read_routed(read, min_lsn)
    return Versioned(value, route.source_lsn)


def _detail_rows(session: Session) -> dict[str, Any]:
    return {"session": row_of(session), "target": row_of(session.target)}


def _detail_of(rows: dict[str, Any]) -> Session:
    session = instance_of(Session, rows["session"])
    session.target = instance_of(ModelVersion, rows["target"])
    return session


# The detail region caches a Session with its target: in Redis as their rows (metadata.cache.codec)
DETAIL_VALUES = ValueCodec(dump=_detail_rows, load=_detail_of)


def build_state_cache(*, local: bool = True, redis: bool = True, coalesce: bool = True,
                      guard: RedisGuard | None = None, config: CacheConfig | None = None) -> TwoTierCache:
    """A session-state cache; the benchmark and tests build variants (a tier or coalescing off)."""
    return TwoTierCache("session_state", load_session_state, WritePolicy.WRITE_THROUGH,
                        local=local, redis=redis, coalesce=coalesce, guard=guard, config=config,
                        batch_loader=load_session_states)


_caches: dict[str, TwoTierCache] = {}
_caches_lock = threading.Lock()


def cache_for(region: str) -> TwoTierCache:
    """The process-wide cache of ``region``."""
    cache = _caches.get(region)
    if cache is None:
        with _caches_lock:
            cache = _caches.get(region)
            if cache is None:
                if region == STATE:
                    cache = build_state_cache()
                elif region == DETAIL:
                    cache = TwoTierCache("session_detail", load_session_detail, WritePolicy.CACHE_ASIDE,
                                         values=DETAIL_VALUES)
                else:
                    raise ValueError(f"unknown session region {region!r}; expected one of {REGIONS}")
                _caches[region] = cache
    return cache


def _ident(session_id: uuid.UUID | str) -> str:
    return str(uuid.UUID(str(session_id)))  # one spelling per session, so one key


def get_session_state(session_id: uuid.UUID | str, tenant_id: int | None = None) -> dict[str, Any] | None:
    """``{"id", "tenant_id", "status", "token_count", "updated_at"}``, or None if there is no such
    session (or, with ``tenant_id``, none of that tenant's). Never older than the caller's own writes."""
    if tenant_id is not None and session_tenant(session_id) != tenant_id:
        return None
    return cache_for(STATE).get(_ident(session_id))


def get_session_detail(session_id: uuid.UUID | str, tenant_id: int | None = None) -> Session | None:
    """The Session (with ``target`` loaded), or None (with ``tenant_id``: also when it is another
    tenant's, whose detail is then never loaded). Treat it as read-only: it may be shared."""
    if tenant_id is not None and session_tenant(session_id) != tenant_id:
        return None
    return cache_for(DETAIL).get(_ident(session_id))


def session_tenant(session_id: uuid.UUID | str) -> int | None:
    """The tenant of ``session_id`` (None: no such session), checked before a tenant's read loads
    anything at the caller's floor.

    Read through the state cache without the caller's floor: a session's tenant never changes, so
    any cached state answers, and a caller's floor (``X-SpecOps-LSN``, the client's own word)
    decides no load of a session that is not its tenant's. A session no tier holds is looked up
    on the primary (a replica may not have it yet), at the primary's probed position.
    """
    ident, cache = _ident(session_id), cache_for(STATE)
    with lsn.floor_scope():
        state = cache.get(ident)
        if state is None:
            with lsn.primary_only():
                state = cache.get(ident)
    return state["tenant_id"] if state is not None else None


def invalidate_session(session_id: uuid.UUID | str, regions: Iterable[str] = REGIONS) -> None:
    """Invalidate the session's cached regions once the current transaction commits."""
    ident = _ident(session_id)
    for region in regions:
        cache_for(region).invalidate(ident)


def invalidate_sessions(session_ids: Iterable[uuid.UUID | str], regions: Iterable[str] = REGIONS) -> None:
    """`invalidate_session` of several sessions, applied together once the transaction commits:
    per region one reload (write-through), one Redis round trip and one broadcast for all."""
    idents = [_ident(session_id) for session_id in session_ids]
    for region in regions:
        cache_for(region).invalidate_many(idents)


def seed_new_session_state(session: Session) -> None:
    """Put a session just inserted (``sessions.submission.admission``) in Redis once it commits.

    What the write-through does after a write, without its read back: the state of a new row is
    known (queued, no tokens), and nothing else can have written the row between its commit and
    the floor read here (its id is known only to this process until the task is published and the
    response sent, both after this). No invalidation: no tier can hold an entry for a new id. The
    floor read is the one the response's ``X-SpecOps-LSN`` needs anyway (it clears the pending
    write). Errors are logged, never raised: the row is committed, and a reader loads it.
    """
    value = {"id": session.pk, "tenant_id": session.tenant_id, "status": str(session.status),
             "token_count": session.token_count, "updated_at": session.updated_at}

    def seed() -> None:
        try:
            position = lsn.capture_primary_lsn()
            lsn.raise_floor(position, writes_captured=True)
            cache = cache_for(STATE)
            if cache.redis_enabled:
                cache.redis.write_through(cache.key(_ident(session.pk)), Versioned(value, position), position)
        except Exception:
            logger.exception("seeding the cached state of new session %s failed; its first read loads it", session.pk)

    transaction.on_commit(seed, using=lsn.PRIMARY_ALIAS)  # at once outside a transaction


@receiver(post_save, sender=Session, dispatch_uid="specops_session_cache_on_save")
def _session_saved(sender, instance: Session, **kwargs) -> None:
    invalidate_session(instance.pk)


@receiver(post_delete, sender=Session, dispatch_uid="specops_session_cache_on_delete")
def _session_deleted(sender, instance: Session, **kwargs) -> None:
    invalidate_session(instance.pk)
