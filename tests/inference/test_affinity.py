"""Conversation affinity: a prompt extending a context a worker recorded goes to that worker's own
queue while it is alive and not full; anything else goes to the model's device queue. Real Redis
(cache and broker); the API's enqueue is checked on the broker's lists."""
from __future__ import annotations

import pytest
from django_redis import get_redis_connection

from inference import affinity
from inference.api.tokenizers import tokenizer_for
from tests.helpers import empty_queue, queued_messages

pytestmark = pytest.mark.django_db
REST = "/api/v1/generations/"
NODE = "celery@affinity-test-a"


@pytest.fixture
def node():
    """This process plays the worker NODE; its records and heartbeat are removed afterwards."""
    connection = get_redis_connection("default")
    affinity.set_node(NODE)
    affinity._last_heartbeat = 0.0
    yield NODE
    affinity.set_node(None)
    for key in connection.scan_iter(match=affinity.RECORD_PREFIX + "*"):
        connection.delete(key)
    connection.delete(affinity.NODE_PREFIX + NODE)
    empty_queue(affinity_queue())


def affinity_queue() -> str:
    return f"{NODE}.dq2"


def test_block_hashes_chain_every_token_before_them_and_are_per_model_version():
    tokens = list(range(100, 140))
    hashes = affinity.block_hashes(7, tokens, block=8)
    assert len(hashes) == 5 and len(set(hashes)) == 5
    assert affinity.block_hashes(7, tokens[:20] + [1, 2, 3], block=8) == hashes[:2]  # a prefix: the same blocks
    assert affinity.block_hashes(7, [99] + tokens[1:], block=8)[4] != hashes[4]  # an early change moves every later one
    assert affinity.block_hashes(8, tokens, block=8)[0] != hashes[0]  # another version shares nothing
    assert affinity.block_hashes(7, tokens[:7], block=8) == []  # no whole block


def test_the_next_turn_goes_to_the_live_node_that_recorded_its_prefix(node):
    conversation = list(range(1000, 1100))
    affinity.record(5, conversation)
    affinity.heartbeat(running=1, capacity=8)
    assert affinity.holder(5, conversation + [7, 7, 7]) == NODE
    assert affinity.holder(5, conversation[:40] + [9] * 60) == NODE  # a partial prefix still points there
    assert affinity.holder(5, [9] * 100) is None  # nothing recorded
    assert affinity.holder(6, conversation) is None  # another model version


def test_a_full_or_silent_node_gets_nothing_routed_to_it(node):
    conversation = list(range(2000, 2064))
    affinity.record(5, conversation)
    affinity.heartbeat(running=8, capacity=8)
    assert affinity.holder(5, conversation) is None  # full: any worker of the queue does better
    get_redis_connection("default").delete(affinity.NODE_PREFIX + NODE)
    assert affinity.holder(5, conversation) is None  # no heartbeat: it may be dead


def test_the_api_enqueues_a_continued_conversation_on_the_holders_queue_and_a_new_one_on_the_model_queue(
        node, api_client, tiny_model):
    first = "def add(a, b):\n    return a + b\n" * 6
    ids = tokenizer_for(str(tiny_model.directory))(first)["input_ids"]
    assert len(ids) >= 2 * 16, "the prompt must span whole blocks"
    affinity.record(tiny_model.pk, ids)
    affinity.heartbeat(running=0, capacity=8)
    empty_queue(affinity_queue())
    before = queued_messages(tiny_model.queue)

    response = api_client.post(REST, {"prompt": first + "def sub(a, b):\n", "max_new_tokens": 4}, format="json")
    assert response.status_code == 202
    assert queued_messages(affinity_queue()) == 1 and queued_messages(tiny_model.queue) == before

    response = api_client.post(REST, {"prompt": "class Point:\n" * 12, "max_new_tokens": 4}, format="json")
    assert response.status_code == 202
    assert queued_messages(affinity_queue()) == 1 and queued_messages(tiny_model.queue) == before + 1
    empty_queue(tiny_model.queue)


def test_with_affinity_off_everything_goes_to_the_model_queue(node, api_client, tiny_model, settings):
    prompt = "def add(a, b):\n    return a + b\n" * 6
    affinity.record(tiny_model.pk, tokenizer_for(str(tiny_model.directory))(prompt)["input_ids"])
    affinity.heartbeat(running=0, capacity=8)
    settings.SPECOPS_PREFIX_AFFINITY = False
    assert affinity.holder(tiny_model.pk, tokenizer_for(str(tiny_model.directory))(prompt)["input_ids"]) is None
    before = queued_messages(tiny_model.queue)
    assert api_client.post(REST, {"prompt": prompt, "max_new_tokens": 4}, format="json").status_code == 202
    assert queued_messages(affinity_queue()) == 0 and queued_messages(tiny_model.queue) == before + 1
    empty_queue(tiny_model.queue)
