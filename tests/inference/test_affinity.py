"""Conversation affinity: a prompt extending a context a worker recorded goes to that worker's own
queue while it is alive and not full; anything else goes to the model's device queue. Real Redis
(cache and broker); the API's enqueue is checked on the broker's lists."""
from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django_redis import get_redis_connection
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from inference import affinity
from inference.tokenizers import tokenizer_for
from metadata.models import Tenant, TenantMembership
from tests.helpers import empty_queue, queued_messages

pytestmark = pytest.mark.django_db
REST = "/api/v1/generations/"
NODE = "celery@affinity-test-a"
SCOPE = "tenant:1"


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
    hashes = affinity.block_hashes(7, SCOPE, tokens, block=8)
    assert len(hashes) == 5 and len(set(hashes)) == 5
    assert affinity.block_hashes(7, SCOPE, tokens[:20] + [1, 2, 3], block=8) == hashes[:2]  # a prefix: the same blocks
    assert affinity.block_hashes(7, SCOPE, [99] + tokens[1:], block=8)[4] != hashes[4]  # an early change moves every later one
    assert affinity.block_hashes(8, SCOPE, tokens, block=8)[0] != hashes[0]  # another version shares nothing
    assert affinity.block_hashes(7, SCOPE, tokens[:7], block=8) == []  # no whole block
    assert affinity.block_hashes(7, "tenant:2", tokens, block=8)[0] != hashes[0]  # another scope shares nothing


def test_the_next_turn_goes_to_the_live_node_that_recorded_its_prefix(node):
    conversation = list(range(1000, 1100))
    affinity.record(5, SCOPE, conversation)
    affinity.heartbeat(running=1, capacity=8)
    assert affinity.holder(5, SCOPE, conversation + [7, 7, 7]) == NODE
    assert affinity.holder(5, SCOPE, conversation[:40] + [9] * 60) == NODE  # a partial prefix still points there
    assert affinity.holder(5, SCOPE, [9] * 100) is None  # nothing recorded
    assert affinity.holder(6, SCOPE, conversation) is None  # another model version


def test_a_full_or_silent_node_gets_nothing_routed_to_it(node):
    conversation = list(range(2000, 2064))
    affinity.record(5, SCOPE, conversation)
    affinity.heartbeat(running=8, capacity=8)
    assert affinity.holder(5, SCOPE, conversation) is None  # full: any worker of the queue does better
    get_redis_connection("default").delete(affinity.NODE_PREFIX + NODE)
    assert affinity.holder(5, SCOPE, conversation) is None  # no heartbeat: it may be dead


def test_the_api_enqueues_a_continued_conversation_on_the_holders_queue_and_a_new_one_on_the_model_queue(
        node, api_client, tenant, tiny_model):
    first = "def add(a, b):\n    return a + b\n" * 6
    ids = tokenizer_for(str(tiny_model.directory))(first)["input_ids"]
    assert len(ids) >= 2 * 16, "the prompt must span whole blocks"
    affinity.record(tiny_model.pk, tenant.prefix_cache_scope(), ids)
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


def test_with_affinity_off_everything_goes_to_the_model_queue(node, api_client, tenant, tiny_model, settings):
    prompt = "def add(a, b):\n    return a + b\n" * 6
    affinity.record(tiny_model.pk, tenant.prefix_cache_scope(), tokenizer_for(str(tiny_model.directory))(prompt)["input_ids"])
    affinity.heartbeat(running=0, capacity=8)
    settings.SPECOPS_PREFIX_AFFINITY = False
    assert affinity.holder(tiny_model.pk, tenant.prefix_cache_scope(), tokenizer_for(str(tiny_model.directory))(prompt)["input_ids"]) is None
    before = queued_messages(tiny_model.queue)
    assert api_client.post(REST, {"prompt": prompt, "max_new_tokens": 4}, format="json").status_code == 202
    assert queued_messages(affinity_queue()) == 0 and queued_messages(tiny_model.queue) == before + 1
    empty_queue(tiny_model.queue)


def test_another_tenants_recorded_blocks_neither_route_nor_show_and_a_group_shares_them(
        node, api_client, tenant, tiny_model):
    """Tenant B's conversation, recorded by the node, routes B's next turn there; tenant A's same
    prompt goes to the model's queue, as if nothing were recorded (routing would otherwise tell A,
    by its queueing, what B sent); once an operator puts A and B in one group, they share."""
    tenant_b = tenant  # api_client's
    tenant_a = Tenant.objects.create(name="affinity-a")
    user_a = get_user_model().objects.create_user("affinity-a-user")
    TenantMembership.objects.create(user=user_a, tenant=tenant_a)
    client_a = APIClient()
    client_a.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user_a).key}")
    prompt = "SECRET_PLAN = 'merge with the competitor on friday'\n" * 4
    ids = tokenizer_for(str(tiny_model.directory))(prompt)["input_ids"]
    assert len(ids) >= 2 * 16, "the prompt must span whole blocks"
    affinity.record(tiny_model.pk, tenant_b.prefix_cache_scope(), ids)
    affinity.heartbeat(running=0, capacity=8)
    assert affinity.holder(tiny_model.pk, tenant_b.prefix_cache_scope(), ids) == NODE
    assert affinity.holder(tiny_model.pk, tenant_a.prefix_cache_scope(), ids) is None
    empty_queue(affinity_queue())

    response = client_a.post(REST, {"prompt": prompt, "max_new_tokens": 4}, format="json")
    assert response.status_code == 202
    assert queued_messages(affinity_queue()) == 0  # A's request knows nothing of B's blocks
    response = api_client.post(REST, {"prompt": prompt, "max_new_tokens": 4}, format="json")
    assert response.status_code == 202
    assert queued_messages(affinity_queue()) == 1  # B's own next turn still goes to its node

    for member in (tenant_a, tenant_b):
        member.prefix_cache_group = "partners"
        member.save()
    affinity.record(tiny_model.pk, tenant_b.prefix_cache_scope(), ids)
    assert tenant_a.prefix_cache_scope() == tenant_b.prefix_cache_scope() == "group:partners"
    response = client_a.post(REST, {"prompt": prompt, "max_new_tokens": 4}, format="json")
    assert response.status_code == 202
    assert queued_messages(affinity_queue()) == 2
    empty_queue(tiny_model.queue)
