"""A generation's admission in one round trip (``sessions.submission.admission``): exact under
concurrent submissions at a tenant's limit, and the new session's state put in Redis without a
read back. Real commits (the quota's lock and the after-commit work only show across
transactions)."""
from __future__ import annotations

import threading

import pytest
from django.db import connections

from inference.api.serializers import GenerationRequestSerializer
from sessions.submission import QuotaExceeded, submit_generation
from metadata.models import Session, SessionStatus, Tenant
from metadata.replicas import lsn
from sessions.state import STATE, cache_for, load_session_state

pytestmark = pytest.mark.django_db(transaction=True)


def valid_request(model: str) -> GenerationRequestSerializer:
    serializer = GenerationRequestSerializer(data={"model": model, "prompt": "x = 1\n", "max_new_tokens": 4,
                                                   "temperature": 0.7})
    assert serializer.is_valid(), serializer.errors
    return serializer


def submit_together(request, tenant: Tenant, threads: int) -> tuple[int, int, list[str]]:
    """``threads`` submissions released at once, each on its own connection: (created, refused, errors)."""
    barrier = threading.Barrier(threads)
    outcomes: list[str] = []

    def submit() -> None:
        try:
            with lsn.primary_only():
                barrier.wait(timeout=30)
                submit_generation(request, tenant, None)
            outcomes.append("created")
        except QuotaExceeded:
            outcomes.append("refused")
        except Exception as exc:  # noqa: BLE001 (reported by the test)
            outcomes.append(f"{type(exc).__name__}: {exc}")
        finally:
            connections.close_all()

    workers = [threading.Thread(target=submit) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    errors = [o for o in outcomes if o not in ("created", "refused")]
    return outcomes.count("created"), outcomes.count("refused"), errors


def test_concurrent_submissions_at_the_limit_take_exactly_the_free_places(tenant, tiny_model):
    tenant.max_live_generations = 4
    tenant.save()
    request = valid_request(tiny_model.name)
    submit_generation(request, tenant, None)  # one live already: three places free
    for round_ in range(3):
        created, refused, errors = submit_together(request, tenant, threads=10)
        assert errors == [] and (created, refused) == (3, 7), (round_, created, refused, errors)
        live = Session.objects.filter(tenant=tenant, status__in=[SessionStatus.QUEUED, SessionStatus.RUNNING])
        assert live.count() == 4
        # three end (succeeded); the next round races for their places
        ended = list(live.order_by("created_at").values_list("pk", flat=True)[:3])
        Session.objects.filter(pk__in=ended).update(status=SessionStatus.SUCCEEDED)
    assert Session.objects.filter(tenant=tenant).count() == 1 + 3 * 3


def test_a_refused_submission_names_the_limit_and_writes_nothing(tenant, tiny_model, settings):
    settings.SPECOPS_TENANT_MAX_LIVE_GENERATIONS = 1
    request = valid_request(tiny_model.name)
    submit_generation(request, tenant, None)
    with pytest.raises(QuotaExceeded) as refused:
        submit_generation(request, tenant, None)
    assert (refused.value.live, refused.value.limit) == (1, 1)
    assert "SPECOPS_TENANT_MAX_LIVE_GENERATIONS" in refused.value.message
    assert Session.objects.filter(tenant=tenant).count() == 1


def test_the_new_sessions_state_is_in_redis_without_a_read_back(api_client, tenant, tiny_model):
    cache = cache_for(STATE)
    loads = cache.loads
    response = api_client.post("/api/v1/generations/", {"prompt": "import os\n", "max_new_tokens": 4,
                                                        "temperature": 0.7}, format="json")
    assert response.status_code == 202, response.content
    session_id = response.json()["id"]
    entry, key_floor = cache.redis.get(cache.key(session_id))
    assert entry is not None and cache.loads == loads  # put there, not loaded
    with lsn.primary_only():
        assert entry.value == load_session_state(session_id).value  # what a read would have cached
    # the floor read after the commit is the one the response carries back to the client
    assert entry.source_lsn == key_floor == lsn.parse_lsn(response[lsn.LSN_HEADER])
    assert entry.value["status"] == SessionStatus.QUEUED and entry.value["token_count"] == 0


@pytest.fixture
def server_binding_alias():
    """A connection to the test database with psycopg's server-side binding (which cannot send two
    statements in one execute): Django picks the cursor class when a connection opens, so an alias
    of this test's own."""
    from django.db.backends.postgresql.base import DatabaseWrapper

    alias = "server_binding"
    settings_dict = dict(connections["default"].settings_dict)
    settings_dict["OPTIONS"] = {**{k: v for k, v in settings_dict.get("OPTIONS", {}).items() if k != "pool"},
                                "server_side_binding": True}
    connections[alias] = DatabaseWrapper(settings_dict, alias)
    yield alias
    connections[alias].close()
    del connections[alias]


def test_the_admission_holds_with_server_side_binding(tenant, tiny_model, server_binding_alias):
    from sessions.submission.admission import insert_within_quota

    tenant.max_live_generations = 2
    tenant.save()
    made = lambda: Session(tenant=tenant, target=tiny_model, drafter="ngram", queue="cpu", prompt="x", prompt_tokens=1)
    first, second, third = made(), made(), made()
    assert connections[server_binding_alias].settings_dict["OPTIONS"]["server_side_binding"]
    admitted = [insert_within_quota(session, using=server_binding_alias) for session in (first, second, third)]
    assert [a.created for a in admitted] == [True, True, False]
    assert [a.live for a in admitted] == [0, 1, 2] and admitted[2].limit == 2 and admitted[2].own_limit
    assert set(Session.objects.filter(tenant=tenant).values_list("pk", flat=True)) == {first.pk, second.pk}
    assert third._state.adding and not first._state.adding  # refused: not marked as saved
