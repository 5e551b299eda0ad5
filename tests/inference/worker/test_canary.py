"""The losslessness canary replays finished greedy generations target-only and reports any that differ.

The wrong-verifier test makes speculation lossy on purpose (a verifier that keeps every draft
token) and shows the canary catching it: a CanaryMismatch row naming the first differing position,
the mismatch counter, the admin page. A real worker with the share at 1 replays its own correct
generation and finds it a match.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client import REGISTRY

from inference.engine import DraftConfig, GenerationConfig, SpeculativeDecoder, build_drafter
from inference.engine.decode import decoder as decoder_module
from inference.engine.decode.target_only import generate_plain
from inference.engine.decode.verify import VerifyResult
from inference.engine.lm.loading import load_model_pair
from inference.models import CanaryMismatch
from inference.worker import canary
from metadata.models import Session, SessionStatus, TokenKind, TokenRecord
from specops.celery import app
from tests.helpers import wait_for
from tests.worker_process import start_worker, stop_worker

PROMPT, NEW = "def parse(text):\n    ", 20


def replays(outcome: str) -> float:
    return REGISTRY.get_sample_value("specops_canary_replays_total", {"outcome": outcome}) or 0.0


def store(tenant, model, tokens: list[int], temperature: float = 0.0, drafter: str = "draft_model") -> Session:
    """A finished session whose committed tokens are `tokens`."""
    now = timezone.now()
    session = Session.objects.create(
        tenant=tenant, target=model, draft=model.default_draft, drafter=drafter, queue="cpu", prompt=PROMPT,
        prompt_tokens=8, status=SessionStatus.SUCCEEDED, token_count=len(tokens), finish_reason="length",
        params={"max_new_tokens": NEW, "temperature": temperature}, created_at=now - timedelta(seconds=2),
        finished_at=now)
    TokenRecord.objects.bulk_create([
        TokenRecord(session=session, session_created_at=session.created_at, position=position, step=position,
                    token_id=token, piece="", kind=TokenKind.ACCEPTED) for position, token in enumerate(tokens)])
    return session


def wrong_verifier(tree, target_argmax):
    """Keeps every draft token and adds the target's next one: lossy whenever a draft is wrong."""
    path, node = [], -1
    while tree.children[node + 1]:
        node = tree.children[node + 1][0]
        path.append(node)
    return VerifyResult(path, target_argmax[len(path)])


@pytest.fixture
def pair(tiny_model):
    return load_model_pair(tiny_model.directory, tiny_model.default_draft.directory)


@pytest.mark.django_db
def test_a_deliberately_wrong_verifier_is_caught_at_its_first_wrong_token(tenant, tiny_model, pair, monkeypatch):
    target, draft = pair
    prompt_ids = target.tokenizer(PROMPT)["input_ids"]
    config = GenerationConfig(max_new_tokens=NEW, eos_token_id=target.tokenizer.eos_token_id)
    expected = generate_plain(target.model, prompt_ids, config).token_ids
    monkeypatch.setattr(decoder_module, "verify_greedy", wrong_verifier)
    lossy = SpeculativeDecoder(target, build_drafter("draft_model", target, draft, DraftConfig(length=4)))
    served = lossy.generate(prompt_ids, config).token_ids
    monkeypatch.undo()
    assert served != expected  # the random draft disagrees with the target: the wrong verifier shows
    session = store(tenant, tiny_model, served)
    before = replays("mismatch")

    assert canary.replay(str(session.pk), loaded=target) == canary.MISMATCH

    mismatch = CanaryMismatch.objects.get(session_id=session.pk)
    differ = next(i for i, (a, b) in enumerate(zip(served, expected)) if a != b)
    assert mismatch.first_difference == differ
    assert mismatch.served_tokens == served and mismatch.replayed_tokens == expected
    assert mismatch.drafter == "draft_model" and mismatch.model == "tiny:1"
    assert mismatch.replayed_text == target.tokenizer.decode(expected)
    assert replays("mismatch") == before + 1


@pytest.mark.django_db
def test_a_lossless_generation_is_a_match_and_leaves_no_row(tenant, tiny_model, pair):
    target, draft = pair
    prompt_ids = target.tokenizer(PROMPT)["input_ids"]
    config = GenerationConfig(max_new_tokens=NEW, eos_token_id=target.tokenizer.eos_token_id)
    served = SpeculativeDecoder(target, build_drafter("draft_model", target, draft)).generate(prompt_ids, config)
    session = store(tenant, tiny_model, served.token_ids)
    before = replays("match")
    assert canary.replay(str(session.pk), loaded=target) == canary.MATCH
    assert not CanaryMismatch.objects.exists() and replays("match") == before + 1


@pytest.mark.django_db
def test_the_share_chooses_greedy_speculative_successes_only(tenant, tiny_model):
    greedy = store(tenant, tiny_model, [1, 2])
    assert canary.chosen(greedy, share=1.0) and not canary.chosen(greedy, share=0.0)
    assert not canary.chosen(store(tenant, tiny_model, [1], temperature=0.7), share=1.0)
    assert not canary.chosen(store(tenant, tiny_model, [1], drafter="none"), share=1.0)
    sessions = [store(tenant, tiny_model, [3]) for _ in range(200)]
    picked = sum(canary.chosen(s, share=0.25) for s in sessions)
    assert 25 <= picked <= 75  # a quarter of 200, by the hash of their ids
    assert [canary.chosen(s, share=0.25) for s in sessions] == [canary.chosen(s, share=0.25) for s in sessions]


@pytest.mark.django_db
def test_the_admin_shows_both_texts_and_where_they_part(admin_client, tenant, tiny_model):
    session = store(tenant, tiny_model, [5, 6, 7])
    mismatch = CanaryMismatch.objects.create(
        session_id=session.pk, session_created_at=session.created_at, model="tiny:1", drafter="tree",
        first_difference=1, served_tokens=[5, 6, 7], replayed_tokens=[5, 9, 7], served_text="served-here",
        replayed_text="replayed-here")
    html = admin_client.get(f"/admin/inference/canarymismatch/{mismatch.pk}/change/").content.decode()
    assert "served-here" in html and "replayed-here" in html
    assert "position 1: served [6] where the target alone gives [9]" in html
    assert admin_client.post(f"/admin/inference/canarymismatch/{mismatch.pk}/delete/").status_code == 403


@pytest.mark.django_db(transaction=True)
def test_a_worker_replays_its_own_generations_and_finds_them_lossless(api_client, tiny_model, tmp_path):
    app.control.purge()
    worker = start_worker("cpu", "canary-cpu", tmp_path / "worker.log", extra_env={"SPECOPS_CANARY_SHARE": "1"})
    try:
        created = api_client.post("/api/v1/generations/", {"prompt": PROMPT, "max_new_tokens": NEW}, format="json")
        assert created.status_code == 202, created.content
        wait_for(lambda: "canary" in (tmp_path / "worker.log").read_text()
                 and "inference.canary_replay" in (tmp_path / "worker.log").read_text()
                 and "succeeded" in (tmp_path / "worker.log").read_text().split("inference.canary_replay", 1)[-1],
                 timeout=120, what="the canary's replay task to run")
    finally:
        stop_worker(worker)
    log = (tmp_path / "worker.log").read_text()
    assert "'match'" in log.split("inference.canary_replay", 1)[-1], log[-2000:]
    assert not CanaryMismatch.objects.exists()
