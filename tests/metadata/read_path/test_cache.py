"""The two-tier cache against the real PostgreSQL, replica and Redis: tiers, single-flight,
invalidation after commit and its broadcast, freshness under a paused replica."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
from django.db import connections, transaction
from prometheus_client import REGISTRY

from metadata.cache import (
    COALESCED,
    HITS,
    LOCAL,
    MISSES,
    REDIS,
    CacheConfig,
    TwoTierCache,
    Versioned,
    WritePolicy,
    snapshot_cache_stats_now,
)
from metadata.models import CacheStatsSnapshot, Session, SessionStatus
from metadata.replicas import lsn
from sessions.state import STATE, cache_for, get_session_state, invalidate_session, load_session_state
from tests.metadata.read_path.conftest import (
    make_session,
    paused_replay,
    replica_alias,
    wait_for_replica_catch_up,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@pytest.fixture
def build_cache() -> Iterator[Callable[..., TwoTierCache]]:
    built: list[TwoTierCache] = []

    def build(name: str = "t_state", policy: WritePolicy = WritePolicy.CACHE_ASIDE, loader=load_session_state,
              **config) -> TwoTierCache:
        cache = TwoTierCache(name, loader, policy, config=CacheConfig(**config))
        built.append(cache)
        return cache

    yield build
    for cache in built:
        cache.close()


def read_in_fresh_scope(cache: TwoTierCache, ident: str) -> tuple[dict | None, tuple[str, ...]]:
    """Read as a caller that wrote nothing, in another thread (outside any open transaction)."""
    out: dict = {}

    def run() -> None:
        with lsn.floor_scope():
            out["value"] = cache.get(ident)
            out["served"] = lsn.served_by()
        connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return out["value"], out["served"]


def set_status(session: Session, status: str) -> None:
    Session.objects.filter(pk=session.pk).update(status=status)


def test_second_read_is_a_local_hit(build_cache, tenant, target_version):
    session = make_session(tenant, target_version)
    wait_for_replica_catch_up()
    cache = build_cache()
    cache.bus.ensure_listening()
    assert cache.bus.connected.wait(5)
    ident = str(session.pk)
    with lsn.floor_scope():
        first = cache.get(ident)
        assert lsn.served_by() == (replica_alias(),)
        second = cache.get(ident)
        assert lsn.served_by() == (replica_alias(), "cache:local")
    assert first == second and first["status"] == SessionStatus.QUEUED
    assert cache.loads == 1
    assert (cache.stats.total(LOCAL, HITS), cache.stats.total(LOCAL, MISSES), cache.stats.total(REDIS, MISSES)) == (1, 1, 1)
    assert REGISTRY.get_sample_value("specops_cache_events_total",
                                     {"cache": "t_state", "tier": "local", "event": "hits"}) >= 1


def test_concurrent_misses_make_one_database_read_across_two_processes(build_cache, tenant, target_version):
    """Two cache instances stand for two processes: own local tier and flights, shared Redis."""
    session = make_session(tenant, target_version)
    wait_for_replica_catch_up()

    def slow_load(ident: str, min_lsn: int) -> Versioned:
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT pg_sleep(0.15)")  # a slow query keeps every reader waiting on it
        return load_session_state(ident, min_lsn)

    caches = [build_cache(loader=slow_load, peer_wait_s=5.0) for _ in range(2)]
    barrier = threading.Barrier(16)
    results: list[dict | None] = []
    errors: list[BaseException] = []

    def reader(cache: TwoTierCache) -> None:
        try:
            with lsn.floor_scope():
                barrier.wait()
                results.append(cache.get(str(session.pk)))
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=reader, args=(caches[i % 2],)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert errors == []
    assert len(results) == 16 and all(r["id"] == session.pk for r in results)
    assert sum(c.loads for c in caches) == 1  # one database read for 16 concurrent misses
    assert sum(c.stats.total(LOCAL, COALESCED) for c in caches) == 14  # 7 followers per process
    assert sum(c.stats.total(REDIS, COALESCED) for c in caches) == 1  # the other process's leader


def test_invalidation_waits_for_commit_and_a_rollback_drops_it(build_cache, tenant, target_version):
    session = make_session(tenant, target_version)
    wait_for_replica_catch_up()
    cache = build_cache()
    ident, key = str(session.pk), cache.key(str(session.pk))
    assert read_in_fresh_scope(cache, ident)[0]["status"] == SessionStatus.QUEUED

    with transaction.atomic():
        set_status(session, SessionStatus.RUNNING)
        cache.invalidate(ident)
        assert cache.redis.get(key)[0] is not None  # not yet: the write is not visible to anyone
        assert read_in_fresh_scope(cache, ident)[0]["status"] == SessionStatus.QUEUED
    entry, key_floor = cache.redis.get(key)
    assert entry is None and key_floor > 0  # after commit: dropped, floor raised
    with lsn.floor_scope():
        assert cache.get(ident)["status"] == SessionStatus.RUNNING

    with transaction.atomic():
        set_status(session, SessionStatus.FAILED)
        cache.invalidate(ident)
        transaction.set_rollback(True)
    assert cache.redis.get(key)[0] is not None  # rolled back: nothing to invalidate
    assert read_in_fresh_scope(cache, ident)[0]["status"] == SessionStatus.RUNNING


def test_write_through_refreshes_redis_at_commit(build_cache, tenant, target_version):
    session = make_session(tenant, target_version)
    cache = build_cache(policy=WritePolicy.WRITE_THROUGH)
    ident = str(session.pk)
    with transaction.atomic():
        set_status(session, SessionStatus.RUNNING)
        cache.invalidate(ident)
    entry, key_floor = cache.redis.get(cache.key(ident))
    assert entry is not None and entry.value["status"] == SessionStatus.RUNNING
    assert entry.source_lsn >= key_floor > 0  # fresh for anyone whose write came before
    assert lsn.current().lsn == key_floor and not lsn.current().write_pending  # writer's floor, no extra read


def test_invalidation_is_broadcast_to_other_processes_local_tiers(build_cache, tenant, target_version):
    session = make_session(tenant, target_version)
    wait_for_replica_catch_up()
    writer, other = build_cache(), build_cache()
    ident, key = str(session.pk), writer.key(str(session.pk))
    other.bus.ensure_listening()
    assert other.bus.connected.wait(5)
    for cache in (writer, other):
        read_in_fresh_scope(cache, ident)
        assert key in cache._local
    received_before = other.bus.received

    set_status(session, SessionStatus.RUNNING)
    writer.invalidate(ident)  # no transaction open: runs at once

    assert wait_until(lambda: key not in other._local, 5)  # evicted by the pub/sub message
    assert other.bus.received > received_before
    value, _ = read_in_fresh_scope(other, ident)
    assert value["status"] == SessionStatus.RUNNING


def test_write_through_broadcast_replaces_other_processes_entries(build_cache, tenant, target_version):
    """Write-through: other processes swap in the new value from Redis instead of evicting, so
    their readers never wait for a reload."""
    session = make_session(tenant, target_version)
    wait_for_replica_catch_up()
    writer, other = build_cache(policy=WritePolicy.WRITE_THROUGH), build_cache(policy=WritePolicy.WRITE_THROUGH)
    ident, key = str(session.pk), writer.key(str(session.pk))
    other.bus.ensure_listening()
    assert other.bus.connected.wait(5)
    read_in_fresh_scope(other, ident)

    with transaction.atomic():
        set_status(session, SessionStatus.RUNNING)
        writer.invalidate(ident)

    def replaced() -> bool:
        found = other._local.get(key)
        return found is not None and found[0].value["status"] == SessionStatus.RUNNING

    assert wait_until(replaced, 5)
    loads = other.loads
    with lsn.floor_scope():
        assert other.get(ident)["status"] == SessionStatus.RUNNING
        assert lsn.served_by() == ("cache:local",)
    assert other.loads == loads


def test_replica_behind_a_write_is_never_cached(own_replica, build_cache, tenant, target_version):
    session = make_session(tenant, target_version)
    wait_for_replica_catch_up()
    cache = build_cache()
    ident, key = str(session.pk), cache.key(str(session.pk))
    with paused_replay():
        stale, served = read_in_fresh_scope(cache, ident)
        assert served == (replica_alias(),) and stale["status"] == SessionStatus.QUEUED
        replica_position = cache.redis.get(key)[0].source_lsn

        with lsn.floor_scope():  # the writer
            set_status(session, SessionStatus.RUNNING)
            cache.invalidate(ident)
            assert cache.get(ident)["status"] == SessionStatus.RUNNING
            assert lsn.served_by() == ("default",)

        # Someone who wrote nothing, on a cold cache: the key's floor keeps them off the paused
        # replica, so the stale row is neither returned nor cached again.
        cache.clear_local()
        fresh, served = read_in_fresh_scope(cache, ident)
        assert fresh["status"] == SessionStatus.RUNNING and served in (("default",), ("cache:redis",))
        entry, key_floor = cache.redis.get(key)
        assert entry.value["status"] == SessionStatus.RUNNING and entry.source_lsn >= key_floor
        # A slow reader that read the replica before the write cannot put its value back.
        assert cache.redis.store_if_fresh(key, Versioned(stale, replica_position)) is False


def test_reads_inside_atomic_bypass_the_cache(build_cache, tenant, target_version):
    session = make_session(tenant, target_version)
    wait_for_replica_catch_up()  # the fresh-scope read below has no floor: any replica may serve it
    cache = build_cache()
    ident = str(session.pk)
    with transaction.atomic():
        set_status(session, SessionStatus.RUNNING)
        assert cache.get(ident)["status"] == SessionStatus.RUNNING  # our own uncommitted row
        transaction.set_rollback(True)
    assert cache.redis.get(cache.key(ident))[0] is None and cache.loads == 1
    assert read_in_fresh_scope(cache, ident)[0]["status"] == SessionStatus.QUEUED


def test_snapshot_writes_one_row_per_cache_and_tier(build_cache, tenant, target_version):
    session = make_session(tenant, target_version)
    wait_for_replica_catch_up()  # reads without a floor: a replica that lacks the row would miss 3 times
    cache = build_cache(name="t_snapshot")
    cache.bus.ensure_listening()
    assert cache.bus.connected.wait(5)  # (re)subscribing empties local tiers: do it before counting
    for _ in range(3):
        read_in_fresh_scope(cache, str(session.pk))

    assert snapshot_cache_stats_now() >= 2
    rows = {row.tier: row for row in CacheStatsSnapshot.objects.filter(cache="t_snapshot")}
    assert (rows[LOCAL].hits, rows[LOCAL].misses) == (2, 1)
    assert (rows[REDIS].hits, rows[REDIS].misses) == (0, 1)
    assert snapshot_cache_stats_now() == 0  # counted once: nothing new since


def test_a_session_write_writes_its_state_through(tenant, target_version):
    """The state region is write-through: a worker's write reloads the entry from the primary once,
    after the commit, and stores it in Redis and here; the next reader loads nothing."""
    session = make_session(tenant, target_version)
    cache = cache_for(STATE)
    cache.bus.ensure_listening()
    assert cache.bus.connected.wait(5)  # (re)subscribing empties local tiers: do it before the write
    key = cache.key(str(session.pk))
    assert cache.policy is WritePolicy.WRITE_THROUGH
    assert get_session_state(session.pk)["status"] == SessionStatus.QUEUED
    assert cache.redis.get(key)[0] is not None
    loads = cache.loads

    with transaction.atomic():
        set_status(session, SessionStatus.RUNNING)
        invalidate_session(session.pk)
        assert cache.loads == loads  # nothing before the commit
    entry, key_floor = cache.redis.get(key)
    assert entry.value["status"] == SessionStatus.RUNNING and entry.source_lsn >= key_floor > 0
    assert cache.loads == loads + 1  # one reload, from the primary, after the commit

    assert get_session_state(session.pk)["status"] == SessionStatus.RUNNING
    assert lsn.served_by()[-1] == "cache:local"
    assert cache.loads == loads + 1
