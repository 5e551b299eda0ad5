"""The decoder's step outputs, stats, branches and adaptive length; drafter construction."""

from __future__ import annotations

import math

import pytest
import torch

from inference.engine import (
    Branch,
    ConfigError,
    DraftConfig,
    GenerationConfig,
    GenerationStats,
    SpeculativeDecoder,
    build_drafter,
)
from inference.engine.decode.draft_length import DraftLengthSchedule
from inference.engine.drafters import DraftRequest, NgramDrafter

from .conftest import draft_model, noisy_copy, target_model

PROMPT = [5, 17, 33, 2, 41, 8]


def _decoder(kind: str, arch: str = "qwen2", **config) -> SpeculativeDecoder:
    target = target_model(arch)
    return SpeculativeDecoder(target, build_drafter(kind, target=target, draft=noisy_copy(arch),
                                                    config=DraftConfig(**config)))


@pytest.mark.parametrize("kind", ["draft_model", "tree", "ngram", "none"])
def test_steps_and_stats_add_up(kind):
    decoder = _decoder(kind, length=4, tree_width=2, tree_depth=3, node_budget=6)
    steps = list(decoder.stream(PROMPT * 3, GenerationConfig(max_new_tokens=40)))
    stats = decoder.stats
    assert stats.steps == len(steps)
    assert stats.new_tokens == sum(len(step.token_ids) for step in steps) == 40
    assert stats.drafted == sum(step.drafted for step in steps)
    assert stats.accepted == sum(step.accepted for step in steps)
    assert stats.mean_accepted_length == pytest.approx((stats.accepted + stats.steps) / stats.steps)
    assert all(a <= d for a, d in zip(stats.accepted_per_position, stats.drafted_per_position))
    assert sum(stats.accepted_per_position) == stats.accepted
    assert stats.total_seconds >= stats.draft_seconds + stats.verify_seconds - 1e-6
    assert stats.tokens_per_second > 0
    data = stats.to_dict()
    assert data["acceptance_rate"] == stats.acceptance_rate
    assert data["acceptance_per_position"] == stats.acceptance_per_position
    if kind == "none":
        assert stats.drafted == 0 and stats.steps == 40
    for step in steps:
        # every step emits the accepted drafts plus the target's own token (unless cut)
        assert len(step.token_ids) == step.accepted + 1 or step.finish_reason is not None


def test_draft_model_acceptance_shows_in_steps():
    decoder = _decoder("draft_model", length=4)
    decoder.generate(PROMPT, GenerationConfig(max_new_tokens=60))
    assert 0 < decoder.stats.acceptance_rate < 1
    assert decoder.stats.steps < 60


def test_branches_carry_draft_scores_and_accepted_lengths():
    decoder = _decoder("tree", tree_width=3, tree_depth=3, node_budget=9)
    for step in decoder.stream(PROMPT, GenerationConfig(max_new_tokens=30)):
        if step.drafted == 0:  # the last token needs no draft
            assert step.branches == [] and step.finish_reason == "length"
            continue
        assert all(isinstance(branch, Branch) for branch in step.branches)
        assert sum(len(b.token_ids) for b in step.branches) >= step.drafted
        assert max(branch.accepted_len for branch in step.branches) == step.accepted
        for branch in step.branches:
            assert branch.score <= 0.0
            assert 0 <= branch.accepted_len <= len(branch.token_ids)
        best = max(step.branches, key=lambda branch: branch.accepted_len)
        if step.finish_reason is None:
            assert step.token_ids[: step.accepted] == list(best.token_ids[: step.accepted])


def test_chain_branch_score_is_the_draft_log_probability():
    target, draft = target_model("llama"), draft_model("llama")
    drafter = build_drafter("draft_model", target=target, draft=draft, config=DraftConfig(length=3))
    drafter.begin(PROMPT)
    tree = drafter.propose(PROMPT, DraftRequest(max_depth=3))
    with torch.inference_mode():
        logits = draft(torch.tensor([PROMPT + tree.token_ids])).logits[0]
    log_probs = logits.log_softmax(-1)
    expected = [float(log_probs[len(PROMPT) - 1 + i, token]) for i, token in enumerate(tree.token_ids)]
    assert tree.token_ids == [int(log_probs[len(PROMPT) - 1 + i].argmax()) for i in range(3)]
    assert tree.log_probs == pytest.approx(expected, abs=1e-9)


def test_adaptive_schedule_grows_on_full_acceptance_and_shrinks_on_rejection():
    schedule = DraftLengthSchedule(DraftConfig(length=3, adaptive=True, min_length=2, max_length=5), 3)
    schedule.update(drafted_depth=3, accepted=3)
    assert schedule.length == 4
    schedule.update(drafted_depth=4, accepted=4)
    schedule.update(drafted_depth=5, accepted=5)
    assert schedule.length == 5
    for _ in range(5):
        schedule.update(drafted_depth=5, accepted=1)
    assert schedule.length == 2
    fixed = DraftLengthSchedule(DraftConfig(length=3), 3)
    fixed.update(drafted_depth=3, accepted=0)
    assert fixed.length == 3


def test_adaptive_length_moves_during_a_generation():
    lengths = []
    decoder = _decoder("draft_model", length=2, adaptive=True, min_length=1, max_length=8)
    for step in decoder.stream(PROMPT, GenerationConfig(max_new_tokens=80)):
        lengths.append(step.drafted)
    assert len(set(lengths)) > 2


def test_confidence_threshold_shortens_drafts():
    eager = _decoder("draft_model", length=8)
    eager.generate(PROMPT, GenerationConfig(max_new_tokens=40))
    cautious = _decoder("draft_model", length=8, confidence_threshold=0.9)
    cautious.generate(PROMPT, GenerationConfig(max_new_tokens=40))
    assert cautious.stats.drafted / cautious.stats.steps < eager.stats.drafted / eager.stats.steps
    assert cautious.stats.acceptance_rate > eager.stats.acceptance_rate


def test_ngram_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(DraftConfig(ngram_size=2))
    drafter.begin([])
    context = [1, 2, 3, 4, 9, 1, 2, 5, 6, 7, 1, 2]
    assert drafter.propose(context, DraftRequest(max_depth=3)).token_ids == [5, 6, 7]
    # the index is incremental: a longer context finds the newer occurrence
    assert drafter.propose(context + [8, 1, 2], DraftRequest(max_depth=2)).token_ids == [8, 1]
    # no bigram match falls back to the last unigram match
    assert drafter.propose(context + [8, 0, 4], DraftRequest(max_depth=2)).token_ids == [9, 1]
    assert drafter.propose([4, 4, 1, 2, 3], DraftRequest(max_depth=3)).token_ids == []
    assert drafter.propose([1, 2, 1, 2], DraftRequest(max_depth=3)).token_ids == [1, 2]


def test_build_drafter_refuses_bad_requests():
    target = target_model("gpt2")
    with pytest.raises(ConfigError, match="drafter"):
        build_drafter("medusa", target=target)
    with pytest.raises(ConfigError, match="draft model"):
        build_drafter("tree", target=target)
    assert build_drafter("none", target=target).nominal_depth == 0


def test_generation_stats_merge_sums_counters():
    first, second = GenerationStats(), GenerationStats()
    first.record_step(drafted=4, depth=4, accepted=2)
    second.record_step(drafted=6, depth=6, accepted=6)
    first.merge(second)
    assert (first.steps, first.drafted, first.accepted, first.rejections) == (2, 10, 8, 1)
    assert first.per_token_acceptance == pytest.approx(8 / 9)
    assert first.drafted_per_position == [2, 2, 2, 2, 1, 1]
    assert first.accepted_per_position == [2, 2, 1, 1, 1, 1]
    assert math.isclose(first.mean_accepted_length, 5.0)
