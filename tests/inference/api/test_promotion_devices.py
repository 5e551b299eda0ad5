"""Promotion only to a device a running worker serves, asked of the workers themselves (Celery's
``active_queues`` broadcast), in the REST API and the admin; the admin's promotion runs in a
transaction of its own (its row locks need one: outside a test's transaction it was a 500)."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from metadata.models import ModelVersion, VersionStatus
from inference.registry import register_version, served_queues
from tests.helpers import empty_queue, wait_for
from tests.worker_process import stop_worker

SERVED = "cpu"
# A bare Celery worker on the tests' broker: it consumes ``cpu`` and answers the control
# broadcast like any worker, without loading Django or a model (the tests' rows are not
# committed, so a SpecOps worker would have nothing to load anyway).
BARE_WORKER = """
import sys
from celery import Celery
Celery("probe", broker=sys.argv[1]).worker_main(
    ["worker", "-Q", sys.argv[2], "-n", "probe@testhost", "--pool", "solo", "--without-gossip",
     "--without-mingle", "--without-heartbeat", "-l", "WARNING"])
"""


@pytest.fixture
def promoter() -> APIClient:
    user = get_user_model().objects.create_user("carol", password="pw-staff-123", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="change_modelversion"))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


@pytest.fixture(autouse=True)
def patient_promotions(monkeypatch) -> None:
    """The bare worker answers the broadcast in milliseconds when the machine is idle; a loaded CI
    machine took over the production second, and the promotion went ahead as "nobody answered"."""
    monkeypatch.setattr("inference.registry.SERVED_QUEUES_TIMEOUT_S", 5.0)


@pytest.fixture
def cpu_worker() -> Iterator[None]:
    """A real Celery worker process consuming the ``cpu`` queue of the tests' broker; no task
    reaches it, it only answers the broadcast. Earlier tests' generate tasks left on ``cpu`` are
    dropped first: with that backlog to take (one solo thread) the bare worker did not answer the
    promotion's broadcast in time, and the promotion went ahead as unanswered."""
    empty_queue(SERVED)
    process = subprocess.Popen([sys.executable, "-c", BARE_WORKER, settings.CELERY_BROKER_URL, SERVED],
                               start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: SERVED in (served_queues(timeout=0.5) or set()), timeout=60, interval=0.2,
                 what="the bare worker's answer")
        yield
    finally:
        stop_worker(process)


@pytest.mark.django_db
def test_a_device_no_worker_serves_is_refused_and_a_served_one_promoted(cpu_worker, promoter, tiny_model):
    far = register_version("tiny", "gpu7", "target", tiny_model.directory, device="cuda:7")
    response = promoter.post(f"/api/v1/models/{far.pk}/promote/")
    assert response.status_code == 400, response.content
    message = response.json()["device"][0]
    assert "cuda:7" in message and "gpu.7" in message and SERVED in message
    far.refresh_from_db()
    assert far.status == VersionStatus.STAGED

    served = register_version("tiny", "2", "target", tiny_model.directory, device="cpu")
    response = promoter.post(f"/api/v1/models/{served.pk}/promote/")
    assert response.status_code == 200 and response.json()["replaced"] == [tiny_model.pk]


@pytest.mark.django_db
def test_the_admin_refuses_an_unserved_device_with_a_message(cpu_worker, admin_client, tiny_model):
    far = register_version("tiny", "gpu7", "target", tiny_model.directory, device="cuda:7")
    page = admin_client.post(f"/admin/metadata/modelversion/{far.pk}/promote/", {"confirmed": "yes"}, follow=True)
    assert "was not promoted" in page.content.decode() and "gpu.7" in page.content.decode()
    far.refresh_from_db()
    assert far.status == VersionStatus.STAGED


@pytest.mark.django_db(transaction=True)
def test_the_admin_promotes_in_a_transaction_of_its_own(admin_client, tiny_model):
    """No test transaction around the request, as in production: the promotion's row locks
    (select_for_update) need the transaction the admin now opens."""
    newer = register_version("tiny", "2", "target", tiny_model.directory)
    response = admin_client.post(f"/admin/metadata/modelversion/{newer.pk}/promote/", {"confirmed": "yes"})
    assert response.status_code == 302
    assert ModelVersion.objects.get(pk=newer.pk).status == VersionStatus.ACTIVE
    assert ModelVersion.objects.get(pk=tiny_model.pk).status == VersionStatus.RETIRED
