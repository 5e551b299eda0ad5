"""A client's ``X-SpecOps-LSN`` floor is bounded by the primary's position and never becomes a
shared cache entry's stamp; another tenant's session is refused before its cache entry is loaded.

The race a forged floor wins without the bound: a reader loads a session's state, the session is
then written and its entry invalidated (write-through: the fresh value is in Redis, the key's
floor raised), and only then does the reader store what it read. Stamped with the client's
``FFFFFFFF/FFFFFFFF``, the stale value passes the floor check and replaces the fresh one, in Redis
and in the reader's process, for every caller until it expires.
"""
from __future__ import annotations

import threading

import pytest
from django.http import HttpResponse, JsonResponse
from django.test import RequestFactory
from django_redis import get_redis_connection

from metadata.cache import codec
from metadata.models import Session, SessionStatus, Tenant
from metadata.replicas import ReadYourWritesMiddleware, lsn
from sessions.state.cache import DETAIL, STATE, cache_for, get_session_state
from tests.metadata.read_path.conftest import make_session, primary_insert_lsn

pytestmark = pytest.mark.django_db(transaction=True)
FORGED = "FFFFFFFF/FFFFFFFF"


def through_middleware(view, header: str = FORGED) -> HttpResponse:
    request = RequestFactory().get("/api/v1/sessions/", HTTP_X_SPECOPS_LSN=header)
    return ReadYourWritesMiddleware(view)(request)


def test_a_forged_floor_is_bounded_by_the_primarys_position_and_not_handed_back(tenant, target_version):
    seen = {}

    def view(request):
        seen["floor"] = lsn.current().lsn
        return HttpResponse("ok")

    before = primary_insert_lsn()
    response = through_middleware(view)
    assert before <= seen["floor"] <= primary_insert_lsn()
    assert lsn.LSN_HEADER not in response or lsn.parse_lsn(response[lsn.LSN_HEADER]) <= primary_insert_lsn()
    # a floor the server handed out is kept as it is
    through_middleware(view, lsn.format_lsn(before))
    assert seen["floor"] == before


def test_a_forged_floor_cannot_make_a_stale_entry_survive_an_invalidation(tenant, target_version):
    session = make_session(tenant, target_version)
    cache, ident = cache_for(STATE), str(session.pk)
    original_loader, read_done, go_on = cache.loader, threading.Event(), threading.Event()

    def slow_loader(ident_, min_lsn):  # the forged reader's load: read, then wait before storing
        loaded = original_loader(ident_, min_lsn)
        read_done.set()
        assert go_on.wait(20)
        return loaded

    def view(request):
        return JsonResponse({"status": get_session_state(session.pk)["status"]})

    answers = []
    reader = threading.Thread(target=lambda: answers.append(through_middleware(view)))
    cache.loader = slow_loader
    try:
        reader.start()
        assert read_done.wait(20), "the forged reader did not load"
    finally:
        cache.loader = original_loader
    session.status = SessionStatus.RUNNING
    session.save()  # committed; the write-through puts "running" in Redis and raises the key's floor
    go_on.set()
    reader.join(20)
    assert answers and answers[0].status_code == 200

    stored, _ = codec.loads(get_redis_connection("default").get(cache.key(ident)))
    assert stored["status"] == "running", "the stale value replaced the fresh one in Redis"
    with lsn.floor_scope():  # anyone, in this process (the forged reader's)
        assert get_session_state(session.pk)["status"] == "running"
    cache.clear_local()
    with lsn.floor_scope():
        assert get_session_state(session.pk)["status"] == "running"


def test_another_tenants_session_is_refused_before_its_detail_is_loaded_or_cached(api_client, target_version):
    other = make_session(Tenant.objects.create(name="other"), target_version)
    detail = cache_for(DETAIL)
    loads = detail.loads
    response = api_client.get(f"/api/v1/sessions/{other.pk}/", HTTP_X_SPECOPS_LSN=FORGED)
    assert response.status_code == 404
    assert detail.loads == loads, "another tenant's session detail was loaded before the tenant check"
    assert get_redis_connection("default").get(detail.key(str(other.pk))) is None
    assert Session.objects.filter(pk=other.pk).exists()
