"""Which workers preload models (and so start an engine core): device workers only."""
from __future__ import annotations

import pytest

from core.queues import is_device_queue
from inference.worker.preload import serves_a_device


@pytest.fixture
def app():
    from specops.celery import app

    queues = app.amqp.queues
    before = queues.consume_from
    yield app
    queues._consume_from = before


@pytest.mark.parametrize("consumed, device", [
    (["cpu"], True), (["gpu.0"], True), (["maintenance"], False), (["maintenance", "gpu.1"], True), ([], True),
])
def test_only_a_worker_of_a_device_queue_preloads(app, consumed, device):
    app.amqp.queues._consume_from = {name: app.amqp.queues[name] for name in consumed} if consumed else None
    assert serves_a_device(app) is device


def test_device_queues_are_cpu_and_gpu_n():
    assert is_device_queue("cpu") and is_device_queue("gpu.3")
    assert not is_device_queue("maintenance") and not is_device_queue("cpux")
