"""A real worker serves `dspark` generations: the target's DSpark drafter registered with
`register_model --dspark`, loaded beside the target, drafting in the batching loop with the
scheduler on as in production, and the output the target's own greedy tokens."""
from __future__ import annotations

import pytest
from django.core.management import call_command

from inference.demo.tiny_models import build_tiny_pair
from inference.engine.lm.loading import load_causal_lm
from metadata.models import TokenRecord
from specops.celery import app
from tests.helpers import generate_and_wait
from tests.inference.engine.dspark_models import write_deepspec_checkpoint
from tests.inference.worker.test_crash_safety import target_greedy
from tests.worker_process import start_worker, stop_worker


@pytest.mark.django_db(transaction=True)
def test_a_worker_serves_dspark_with_the_targets_own_greedy_output(api_client, tmp_path):
    target_dir, draft_dir = build_tiny_pair(tmp_path / "models", arch="llama", seed=3)
    checkpoint = write_deepspec_checkpoint(tmp_path / "dspark", load_causal_lm(target_dir).model,
                                           target_layer_ids=(-1, 0), block_size=4, confidence_bias=8.0)
    call_command("register_model", "feat", "1", str(target_dir), "--draft", str(draft_dir),
                 "--dspark", str(checkpoint), "--promote")
    prompt, new = "def parse(text):\n    ", 24
    app.control.purge()
    worker = start_worker("cpu", "dspark-cpu", tmp_path / "worker.log")
    try:
        body = generate_and_wait(api_client, {"model": "feat", "prompt": prompt, "max_new_tokens": new,
                                              "drafter": "dspark"})
    finally:
        stop_worker(worker)
    assert body["status"] == "succeeded", body["error"]
    assert body["stats"]["drafter"] == "dspark"
    assert body["stats"]["drafted"] > 0, body["stats"]  # it drafted: the features reached it
    tokens = list(TokenRecord.objects.filter(session_id=body["id"]).order_by("position")
                  .values_list("token_id", flat=True))
    assert tokens == target_greedy(target_dir, prompt, new)
