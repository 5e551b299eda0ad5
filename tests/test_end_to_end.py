"""One generation end to end: API → real broker → real Celery worker → PostgreSQL → API."""
from __future__ import annotations

import pytest
import torch

from inference.engine.lm.loading import load_causal_lm
from metadata.models import Candidate, Session, TokenRecord
from specops.celery import app
from tests.helpers import wait_for
from tests.worker_process import start_worker, stop_worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def cpu_worker(django_db_setup, tmp_path_factory):
    app.control.purge()
    process = start_worker("cpu", "e2e-cpu", tmp_path_factory.mktemp("worker") / "worker.log")
    yield process
    stop_worker(process)


def target_greedy(model_dir, prompt: str, max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation, by plain argmax steps (no cache, no engine)."""
    loaded = load_causal_lm(model_dir)
    ids = loaded.tokenizer(prompt, return_tensors="pt")["input_ids"]
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            next_id = int(loaded.model(ids).logits[0, -1].argmax())
            out.append(next_id)
            if next_id == loaded.tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out


def finished(api_client, session_id):
    body = api_client.get(f"/api/v1/sessions/{session_id}/").json()
    return body if body["status"] in ("succeeded", "failed") else None


@pytest.mark.parametrize("drafter", ["draft_model", "tree", "ngram"])
def test_generation_runs_through_a_real_worker(api_client, tiny_model, cpu_worker, drafter):
    prompt = "def parse(text):\n    "
    created = api_client.post("/api/v1/generations/", {"prompt": prompt, "max_new_tokens": 24,
                                                       "drafter": drafter}, format="json")
    assert created.status_code == 202, created.content
    session_id = created.json()["id"]
    body = wait_for(lambda: finished(api_client, session_id), timeout=120, what="the generation to finish")

    assert body["status"] == "succeeded", body["error"]
    expected = target_greedy(tiny_model.directory, prompt, 24)
    tokens = list(TokenRecord.objects.filter(session_id=session_id).order_by("position"))
    assert [t.token_id for t in tokens] == expected  # greedy speculative == the target's greedy
    assert body["token_count"] == len(expected) and body["text"]
    assert body["stats"]["steps"] >= 1

    listed = api_client.get(f"/api/v1/sessions/{session_id}/tokens/?page_size=10").json()
    assert [t["token_id"] for t in listed["results"]] == expected[:10]
    if drafter != "ngram":  # every step that drafted left its candidates (not the prefill's, nor one with no room)
        drafted_steps = sum(n for depth, n in body["stats"]["depth_choices"].items() if int(depth) > 0)
        stepped = Candidate.objects.filter(session_id=session_id).values("step").distinct().count()
        assert stepped >= drafted_steps > 0


def test_concurrent_generations_share_the_batch_and_each_equals_the_targets_greedy(
        api_client, tiny_model, cpu_worker):
    prompts = ["def parse(text):\n    ", "import os\n", "class Node:\n    def", "for i in range("]
    ids = []
    for prompt in prompts:
        created = api_client.post("/api/v1/generations/", {"prompt": prompt, "max_new_tokens": 20,
                                                           "drafter": "draft_model"}, format="json")
        assert created.status_code == 202, created.content
        ids.append(created.json()["id"])
    bodies = [wait_for(lambda sid=sid: finished(api_client, sid), timeout=120, what="a generation")
              for sid in ids]
    for prompt, sid, body in zip(prompts, ids, bodies):
        assert body["status"] == "succeeded", body["error"]
        tokens = TokenRecord.objects.filter(session_id=sid).order_by("position")
        assert [t.token_id for t in tokens] == target_greedy(tiny_model.directory, prompt, 20)
    # the worker held them together: at least one step verified several sessions at once
    assert max(body["stats"]["batch_rows_max"] for body in bodies) >= 2


def test_the_depth_of_every_step_is_recorded_in_the_sessions_stats(api_client, tiny_model, cpu_worker):
    created = api_client.post("/api/v1/generations/", {"prompt": "def f(x):\n", "max_new_tokens": 16},
                              format="json").json()
    body = wait_for(lambda: finished(api_client, created["id"]), timeout=120, what="the generation")
    assert body["status"] == "succeeded", body["error"]
    choices = body["stats"]["depth_choices"]
    assert sum(choices.values()) == body["stats"]["steps"]
    assert body["stats"]["drafter"] in ("draft_model", "tree", "ngram", "none")


def test_a_redelivered_task_writes_nothing_twice(api_client, tiny_model, cpu_worker):
    created = api_client.post("/api/v1/generations/", {"prompt": "import sys\n", "max_new_tokens": 16},
                              format="json").json()
    wait_for(lambda: finished(api_client, created["id"]), timeout=120, what="the generation to finish")
    before = TokenRecord.objects.filter(session_id=created["id"]).count()
    # A redelivery after a crash mid-run: the session is still marked running.
    Session.objects.filter(pk=created["id"]).update(status="running")
    from inference.tasks import generate

    generate.apply_async(args=[created["id"]], queue="cpu")
    wait_for(lambda: finished(api_client, created["id"]), timeout=120, what="the redelivered task")
    assert TokenRecord.objects.filter(session_id=created["id"]).count() == before


def test_rabbitmq_works_as_the_broker(api_client, tenant, tiny_model, tmp_path, amqp_url):
    """Setting CELERY_BROKER_URL to RabbitMQ is all it takes: a worker on amqp runs the task."""
    from inference.tasks import generate

    worker = start_worker("cpu", "e2e-amqp", tmp_path / "worker.log", broker_url=amqp_url)
    try:
        # Written directly (not through the API, which publishes to the Redis broker) so that only
        # the RabbitMQ worker can run it.
        session = Session.objects.create(tenant=tenant, target=tiny_model, drafter="ngram", queue="cpu",
                                         prompt="class A:\n", prompt_tokens=3, params={"max_new_tokens": 8})
        with app.connection_for_write(amqp_url) as connection:
            generate.apply_async(args=[str(session.pk)], queue="cpu", connection=connection)
        body = wait_for(lambda: finished(api_client, session.pk), timeout=120, what="the amqp worker")
        assert body["status"] == "succeeded" and body["token_count"] >= 1
    finally:
        stop_worker(worker)
