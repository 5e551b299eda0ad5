"""Several sessions' cache entries invalidated together (``invalidate_sessions``): what the batching
worker's progress write does for every running session at once. After the commit, per region:
one reload of all the states from the primary, one Redis pipeline, one broadcast."""
from __future__ import annotations

import uuid

import pytest
from django.db import connections, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from metadata.cache import RedisGuard, TwoTierCache, WritePolicy
from metadata.cache.redis_tier import fail_fast_client
from metadata.models import Session, SessionStatus
from metadata.replicas import lsn
from sessions.state import DETAIL, STATE, cache_for, get_session_detail, get_session_state, invalidate_sessions
from sessions.state.cache import load_session_states
from tests.metadata.read_path.conftest import make_session

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


def _state_reads(queries: CaptureQueriesContext) -> list[str]:
    return [query["sql"] for query in queries.captured_queries if query["sql"].startswith("SELECT id, tenant_id")]


def test_sessions_invalidated_together_are_reloaded_in_one_read_and_written_through(tenant, target_version):
    sessions = [make_session(tenant, target_version) for _ in range(3)]
    legacy = make_session(tenant, target_version, id=uuid.uuid4(), created_at=timezone.now())  # no time in its id
    sessions.append(legacy)
    state, detail = cache_for(STATE), cache_for(DETAIL)
    state.bus.ensure_listening()
    assert state.bus.connected.wait(5)  # (re)subscribing empties local tiers: do it before the write
    with lsn.floor_scope():
        for session in sessions:
            assert get_session_state(session.pk)["status"] == SessionStatus.QUEUED
            assert get_session_detail(session.pk) is not None
    loads = state.loads

    with lsn.floor_scope(), CaptureQueriesContext(connections["default"]) as queries:
        with transaction.atomic():
            Session.objects.filter(pk__in=[s.pk for s in sessions]).update(
                status=SessionStatus.RUNNING, token_count=F("token_count") + 4)
            invalidate_sessions(s.pk for s in sessions)
            assert state.loads == loads and not _state_reads(queries)  # nothing before the commit
        floor = lsn.current().lsn

    assert state.loads == loads + 1  # one reload for the four, from the primary, after the commit
    assert len(_state_reads(queries)) == 1, _state_reads(queries)
    for session in sessions:
        entry, key_floor = state.redis.get(state.key(str(session.pk)))
        assert entry.value["status"] == SessionStatus.RUNNING and entry.value["token_count"] == 4
        assert entry.source_lsn >= key_floor == floor > 0
        gone, detail_floor = detail.redis.get(detail.key(str(session.pk)))
        assert gone is None and detail_floor == floor  # the cache-aside region: dropped, floor raised
    with lsn.floor_scope(floor):
        assert {get_session_state(s.pk)["token_count"] for s in sessions} == {4}
        assert lsn.served_by() == ("cache:local",)  # written through here too: no read
    assert state.loads == loads + 1


def test_a_rolled_back_write_invalidates_none_and_a_deleted_session_is_dropped(tenant, target_version):
    kept, deleted = make_session(tenant, target_version), make_session(tenant, target_version)
    state = cache_for(STATE)
    with lsn.floor_scope():
        for session in (kept, deleted):
            get_session_state(session.pk)
    before = {s.pk: state.redis.get(state.key(str(s.pk))) for s in (kept, deleted)}

    with transaction.atomic():
        Session.objects.filter(pk=kept.pk).update(status=SessionStatus.FAILED)
        invalidate_sessions([kept.pk, deleted.pk])
        transaction.set_rollback(True)
    assert {s.pk: state.redis.get(state.key(str(s.pk))) for s in (kept, deleted)} == before

    with transaction.atomic():
        Session.objects.filter(pk=deleted.pk).delete()
        Session.objects.filter(pk=kept.pk).update(status=SessionStatus.FAILED)
        invalidate_sessions([kept.pk, deleted.pk])
    entry, _ = state.redis.get(state.key(str(kept.pk)))
    assert entry.value["status"] == SessionStatus.FAILED
    gone, floor = state.redis.get(state.key(str(deleted.pk)))
    assert gone is None and floor > 0  # no row to write through: invalidated instead
    with lsn.floor_scope():
        assert get_session_state(deleted.pk) is None


def test_load_session_states_reads_only_the_sessions_asked_for(tenant, target_version):
    asked = [make_session(tenant, target_version) for _ in range(2)]
    make_session(tenant, target_version)  # another session of the same partition
    missing = str(uuid.uuid4())
    loaded = load_session_states([str(s.pk) for s in asked] + [missing], lsn.NO_LSN)
    assert set(loaded) == {str(s.pk) for s in asked}
    assert all(loaded[str(s.pk)].value["id"] == s.pk for s in asked)


def test_redis_down_keeps_every_key_for_the_replay(tenant, target_version):
    sessions = [make_session(tenant, target_version) for _ in range(2)]
    with socket_nobody_listens_on() as port:
        guard = RedisGuard(lambda: fail_fast_client(f"redis://127.0.0.1:{port}/0"), retry_s=60)
        cache = TwoTierCache("t_many_down", load_session_states_one, WritePolicy.WRITE_THROUGH, guard=guard,
                             batch_loader=load_session_states)
        try:
            cache.apply_invalidations([str(s.pk) for s in sessions], 1234)
            assert cache._unsent == {cache.key(str(s.pk)): 1234 for s in sessions}
        finally:
            cache.close()


def load_session_states_one(ident: str, min_lsn: int = 0):
    from sessions.state.cache import load_session_state

    return load_session_state(ident, min_lsn)


class socket_nobody_listens_on:
    """A loopback port that was free a moment ago (bound, then closed): connections are refused."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]

    def __exit__(self, *exc) -> None:
        return None
