"""The sampled operational gauges read the real broker and database."""
from __future__ import annotations

import pytest
import redis
from django.conf import settings
from django.utils import timezone
from prometheus_client import REGISTRY

from metadata.models import RequestLog
from ops.tasks import sample_ops_metrics


@pytest.mark.django_db
def test_sample_counts_queued_messages_and_default_partition_rows():
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    broker.delete("maintenance")
    broker.lpush("maintenance", b"{}", b"{}", b"{}")
    # Far beyond any partition made ahead, so the row can only land in the DEFAULT partition.
    far_future = timezone.now().replace(year=2100)
    RequestLog.objects.create(requested_at=far_future, method="GET", path="/", status_code=200, duration_ms=1)
    try:
        sample = sample_ops_metrics()
    finally:
        broker.delete("maintenance")
    assert sample["queues"]["maintenance"] == 3
    assert sample["default_rows"]["metadata_request_log"] == 1
    assert sample["default_rows"]["metadata_token"] == 0
    assert REGISTRY.get_sample_value("specops_celery_queue_length", {"queue": "maintenance"}) == 3
    assert sample["archival_jobs"]["failed"] == 0
