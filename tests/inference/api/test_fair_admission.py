"""Fair admission across tenants: each generation's message carries a priority from its tenant's
load, and the broker hands a quiet tenant's request out before a noisy tenant's backlog.

On the real broker (Redis, the default; RabbitMQ on a queue declared with ``x-max-priority``): the
messages are taken off the queue as a worker would, one at a time."""
from __future__ import annotations

import pytest
from kombu import Connection, Queue

from sessions.submission import PRIORITY_LEVELS, broker_priority, load_rank
from sessions.tasks import generate
from tests.inference.api.test_tenant_quotas import client_of, rest

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


def test_a_tenant_with_less_in_flight_gets_a_more_urgent_priority_on_either_broker():
    assert [load_rank(n) for n in (0, 1, 2, 3, 4, 7, 8, 255, 256, 10_000)] == [0, 1, 2, 2, 3, 3, 4, 8, 9, 9]
    redis_first, amqp_first = broker_priority(0, "redis://h/0"), broker_priority(0, AMQP_URL)
    assert redis_first == 0 and amqp_first == PRIORITY_LEVELS - 1  # Redis takes 0 first, AMQP the highest
    assert broker_priority(50, "redis://h/0") > redis_first and broker_priority(50, AMQP_URL) < amqp_first


def take_all(connection: Connection, queue: str) -> list[str]:
    """Session ids in the order the broker hands the messages out (a worker's order)."""
    bound = Queue(queue)(connection.default_channel)
    taken = []
    while (message := bound.get(no_ack=True)) is not None:
        args, _kwargs, _embed = message.decode()
        taken.append(args[0])
    return taken


@pytest.mark.django_db
def test_a_quiet_tenants_request_is_taken_before_a_noisy_tenants_backlog(api_client, tiny_model):
    queue = tiny_model.queue
    with generate.app.connection_for_read() as connection:
        connection.default_channel.queue_purge(queue)  # earlier tests' messages (no worker reads this db)
        noisy = [rest(api_client).json()["id"] for _ in range(5)]  # in flight before each: 0, 1, 2, 3, 4
        quiet = rest(client_of("quiet")).json()["id"]  # nothing in flight
        taken = take_all(connection, queue)
    # Ranks: noisy 0, 1, 2, 2, 3; quiet 0 (first in first out within a rank).
    assert taken == [noisy[0], quiet, *noisy[1:]]


def test_rabbitmq_honours_the_same_priorities_on_a_queue_with_x_max_priority(settings, amqp_url):
    """RabbitMQ needs the queue's x-max-priority (SPECOPS_AMQP_QUEUE_MAX_PRIORITY); a queue of this
    test's own, since a queue declared without it cannot be redeclared with it."""
    queue = Queue("specops-test-fair-admission", max_priority=PRIORITY_LEVELS - 1, auto_delete=False)
    with Connection(amqp_url, connect_timeout=5) as connection:
        connection.ensure_connection(max_retries=1)  # make test starts RabbitMQ: unreachable is a failure
        bound = queue(connection.default_channel)
        bound.declare()
        bound.purge()
        try:
            for name, live in (("noisy-0", 0), ("noisy-1", 1), ("noisy-2", 2), ("noisy-3", 3), ("quiet", 0)):
                generate.apply_async(args=[name], queue=queue, connection=connection,
                                     priority=broker_priority(live, amqp_url))
            assert take_all(connection, queue.name) == ["noisy-0", "quiet", "noisy-1", "noisy-2", "noisy-3"]
        finally:
            bound.delete()


def test_the_broker_is_configured_for_the_priorities(settings):
    """Redis: ten priority lists per queue; RabbitMQ: x-max-priority on the queues only when asked
    (a queue declared without it cannot be redeclared with it)."""
    from celery import Celery

    from specops.celery import PRIORITY_STEPS, app, set_visibility_timeout

    assert app.conf.broker_transport_options["priority_steps"] == PRIORITY_STEPS == list(range(PRIORITY_LEVELS))
    assert app.conf.task_queue_max_priority is None  # SPECOPS_AMQP_QUEUE_MAX_PRIORITY=0, the default
    settings.SPECOPS_AMQP_QUEUE_MAX_PRIORITY = PRIORITY_LEVELS - 1
    fresh = Celery("fair-admission-test", set_as_current=False)
    set_visibility_timeout(fresh)
    assert fresh.conf.task_queue_max_priority == PRIORITY_LEVELS - 1
    assert fresh.amqp.queues.select_add("gpu.7").queue_arguments == {"x-max-priority": PRIORITY_LEVELS - 1}
