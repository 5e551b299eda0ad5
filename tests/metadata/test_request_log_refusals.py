"""The request log (``metadata.request_log``): no row for a refused request (401, 429) or
any request without an authenticated caller (counted in a Prometheus counter instead), so
anonymous clients and made-up tokens cannot fill the table; rows written in batches off the
request path."""
from __future__ import annotations

import pytest
from django.core.cache import cache
from django.utils import timezone
from rest_framework.test import APIClient

from metadata.models import RequestLog
from metadata.request_log.middleware import UNAUTHENTICATED, RequestLogWriter


@pytest.fixture(autouse=True)
def fresh_counters(settings):
    cache.delete_pattern("throttle:*")
    settings.SPECOPS_THROTTLE_USER_RATE = "none"
    settings.SPECOPS_THROTTLE_TENANT_RATE = "none"


@pytest.mark.django_db
def test_bad_tokens_write_no_rows():
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + "f" * 40)
    codes = [client.get("/api/v1/sessions/").status_code for _ in range(5)]
    assert codes == [401] * 5
    assert APIClient().get("/api/v1/sessions/").status_code == 401  # no token at all
    assert RequestLog.objects.count() == 0


@pytest.mark.django_db
def test_throttled_requests_write_no_rows_and_served_ones_do(api_client, settings):
    settings.SPECOPS_THROTTLE_USER_RATE = "2/min"
    codes = [api_client.get("/api/v1/sessions/").status_code for _ in range(4)]
    assert codes == [200, 200, 429, 429]
    assert list(RequestLog.objects.values_list("status_code", flat=True)) == [200, 200]


@pytest.mark.django_db(transaction=True)
def test_rows_outside_a_transaction_are_written_together_by_the_writer():
    writer = RequestLogWriter()
    now = timezone.now()
    for status in (200, 404, 500):
        writer.add(RequestLog(requested_at=now, method="GET", path="/api/v1/x/", status_code=status, duration_ms=1.0))
    assert RequestLog.objects.count() == 0 or RequestLog.objects.count() == 3  # the thread may have flushed
    writer.flush()
    assert sorted(RequestLog.objects.values_list("status_code", flat=True)) == [200, 404, 500]
    assert writer.flush() == 0  # nothing left


def unauthenticated_count(status: str) -> float:
    return UNAUTHENTICATED.labels(status=status)._value.get()


@pytest.mark.django_db
def test_unauthenticated_requests_are_counted_not_logged(api_client):
    before = unauthenticated_count("404"), unauthenticated_count("401")
    anonymous = APIClient()
    codes = {anonymous.get(f"/api/v1/no-such-thing-{n}/").status_code for n in range(200)}
    assert codes == {404}
    assert anonymous.post("/api/v1/generations/", {}, format="json").status_code == 401
    assert RequestLog.objects.count() == 0
    assert unauthenticated_count("404") == before[0] + 200 and unauthenticated_count("401") == before[1] + 1
    # an authenticated caller's request is logged, a 404 from a view included
    assert api_client.get("/api/v1/sessions/01234567-89ab-7def-8123-456789abcdef/").status_code == 404
    assert list(RequestLog.objects.values_list("status_code", flat=True)) == [404]
