"""Every rate limit of a request counted in one Redis round trip (``core.throttles.count_requests``)."""
from __future__ import annotations

import pytest
from django.core.cache import cache
from django_redis import get_redis_connection

from core import throttles


@pytest.fixture(autouse=True)
def fresh_counters(settings):
    cache.delete_pattern("throttle:*")
    settings.SPECOPS_THROTTLE_USER_RATE = "100/min"
    settings.SPECOPS_THROTTLE_TENANT_RATE = "100/min"
    settings.SPECOPS_THROTTLE_GENERATION_RATE = "100/min"


@pytest.fixture
def round_trips(monkeypatch):
    calls = []
    count = throttles.count_requests

    def counting(batch, request, view):
        batch = list(batch)
        calls.append(sorted(type(t).__name__ for t in batch))
        return count(batch, request, view)

    monkeypatch.setattr(throttles, "count_requests", counting)
    return calls


def window_counts() -> dict[str, int]:
    client = get_redis_connection("default")
    return {key.decode().split("throttle:")[1].rsplit(":", 1)[0]: int(client.get(key))
            for key in client.scan_iter(match="*throttle:*")}


@pytest.mark.django_db
def test_a_generation_is_counted_against_user_tenant_and_generation_rates_at_once(
        api_client, api_user, tenant, tiny_model, round_trips):
    response = api_client.post("/api/v1/generations/", {"prompt": "import os\n", "max_new_tokens": 4}, format="json")

    assert response.status_code == 202
    assert round_trips == [["GenerationRateThrottle", "TenantRateThrottle", "UserRateThrottle"]]
    assert window_counts() == {f"user:{api_user.pk}": 1, f"tenant:{tenant.pk}": 1, f"generation:{api_user.pk}": 1}


@pytest.mark.django_db
def test_a_read_is_counted_once_per_rate_and_refused_past_the_lower_one(api_client, api_user, tenant, settings,
                                                                         round_trips):
    settings.SPECOPS_THROTTLE_TENANT_RATE = "2/min"
    codes = [api_client.get("/api/v1/sessions/").status_code for _ in range(3)]

    assert codes == [200, 200, 429]
    assert len(round_trips) == 3  # one per request, both rates in it
    assert window_counts() == {f"user:{api_user.pk}": 3, f"tenant:{tenant.pk}": 3}


def test_throttle_wait_counts_plain_views_in_one_round_trip(rf, django_user_model, round_trips, settings, db):
    settings.SPECOPS_THROTTLE_USER_RATE = "1/min"
    request = rf.get("/v1/models")
    request.user = django_user_model.objects.create_user("plain")

    assert throttles.throttle_wait(request, generation=True) is None
    wait, limit = throttles.throttle_wait(request, generation=True)

    assert 1 <= wait <= 60 and limit == "SPECOPS_THROTTLE_USER_RATE=1/min"
    assert len(round_trips) == 2


def test_a_window_that_begins_between_reading_and_counting_is_no_error(rf, django_user_model, settings, db):
    """The first window key is read at 99.9999 s, the count at 100.0 s: the request is counted
    in the new window and judged by that count (it was a KeyError, a 500, once a minute)."""
    settings.SPECOPS_THROTTLE_USER_RATE = "100/s"
    request = rf.get("/api/v1/sessions/")
    request.user = django_user_model.objects.create_user("edge")
    clock = iter([99.9999, 100.0, 100.0])
    throttle = throttles.UserRateThrottle()
    throttle.timer = lambda: next(clock)

    assert throttle.allow_request(request, None) is True
    assert window_counts() == {f"user:{request.user.pk}": 1}
