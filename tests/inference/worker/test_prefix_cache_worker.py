"""A chat's second turn through a real worker (engine core, default settings): its prompt starts
with the first turn's prompt and reply, so it adopts them from the device's prefix cache, says so
in its stats, and still gives the target's own greedy tokens; the worker recorded the first turn
for conversation affinity under its own node name."""
from __future__ import annotations

import pytest
from django_redis import get_redis_connection

from inference import affinity
from inference.tokenizers import tokenizer_for
from tests.helpers import wait_for
from tests.inference.worker.test_crash_safety import WORKER_ENV, assert_ended_once, generation, nonce_prompt, target_greedy
from tests.test_end_to_end import finished
from tests.worker_process import start_worker, stop_worker

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
NODE = "prefix-turns@testhost"


def test_the_second_turn_adopts_the_first_from_the_prefix_cache_and_is_still_the_targets_output(
        api_client, tenant, tiny_model, tmp_path):
    first_prompt = nonce_prompt("# a helper module\n" + "def add(a, b):\n    return a + b\n\n" * 4)
    worker = start_worker("cpu", NODE.split("@")[0], tmp_path / "worker.log", extra_env=WORKER_ENV)
    try:
        first_id = generation(api_client, first_prompt, 24)
        first = wait_for(lambda: finished(api_client, first_id), timeout=120, what="the first turn")
        second_prompt = first_prompt + first["text"] + "\n\ndef sub(a, b):\n"
        second_id = generation(api_client, second_prompt, 24)
        second = wait_for(lambda: finished(api_client, second_id), timeout=120, what="the second turn")
        # a third turn through the OpenAI API: its usage says what the cache held
        third = api_client.post("/v1/completions", {"model": tiny_model.name, "prompt": second_prompt + second["text"],
                                                    "max_tokens": 4, "temperature": 0}, format="json")
    finally:
        stop_worker(worker)
    assert first["status"] == second["status"] == "succeeded", (first["error"], second["error"])
    assert first["stats"]["cached_tokens"] == 0
    context = len(tokenizer_for(str(tiny_model.directory))(second_prompt)["input_ids"])
    # whole 16-token blocks of the first turn's prompt and reply, at least its prompt's
    assert second["stats"]["cached_tokens"] >= 16 * (first["stats"]["prompt_tokens"] // 16) > 0
    assert second["stats"]["prefill_tokens"] == context - second["stats"]["cached_tokens"]
    assert third.status_code == 200, third.content
    usage = third.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= second["stats"]["cached_tokens"] > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    assert_ended_once(api_client, second_id, target_greedy(tiny_model.directory, second_prompt, 24))
    ids = tokenizer_for(str(tiny_model.directory))(second_prompt)["input_ids"]
    recorded = [affinity.RECORD_PREFIX + digest for digest in affinity.block_hashes(tiny_model.pk, tenant.prefix_cache_scope(), ids)]
    holders = {value.decode() for value in get_redis_connection("default").mget(recorded) if value is not None}
    assert holders == {NODE}
