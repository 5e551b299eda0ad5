"""The tree drafter: calibrated node values, learning from outcomes, and beating a chain."""

from __future__ import annotations

import math

import pytest
import torch

from inference.engine import (
    DraftConfig,
    GenerationConfig,
    GenerationStats,
    SpeculativeDecoder,
    build_drafter,
)
from inference.engine.drafters import DraftRequest
from inference.engine.drafters.calibration import AcceptanceCalibration

from .conftest import noisy_copy, target_model

PROMPTS = ([5, 9, 12, 40, 7, 3], [1, 2, 3], [50, 60, 70, 80], [11, 22, 33])


def test_calibration_starts_calibrated_and_learns_per_rank():
    calibration = AcceptanceCalibration(ranks=2, buckets=10)
    before = calibration.log_value(torch.tensor([[0.15, 0.15]]))[0].tolist()
    assert before == pytest.approx([math.log(0.15), math.log(0.15)])
    for _ in range(50):  # same draft probability, but the target always takes rank 0
        calibration.observe([0.15, 0.15], [True, False])
    rank0, rank1 = calibration.log_value(torch.tensor([[0.15, 0.15]]))[0].exp().tolist()
    assert rank0 > 0.9 and rank1 < 0.01
    untouched = calibration.log_value(torch.tensor([[0.85, 0.05]]))[0].exp().tolist()
    assert untouched == pytest.approx([0.85, 0.05])


def test_tree_drafter_learns_from_the_path_the_target_took():
    target, draft = target_model("llama"), noisy_copy("llama", 0.2)
    drafter = build_drafter("tree", target=target, draft=draft,
                            config=DraftConfig(tree_width=3, tree_depth=4, node_budget=8))
    prior_trials = float(drafter.calibration.trials.sum())
    SpeculativeDecoder(target, drafter).generate(PROMPTS[0], GenerationConfig(max_new_tokens=32))
    learned = drafter.calibration.trials.sum() - prior_trials
    # every step observes at least the root's three candidates
    assert learned >= 3 * 8


def test_tree_is_closed_under_ancestors_and_within_budget():
    target, draft = target_model("qwen2"), noisy_copy("qwen2", 0.2)
    drafter = build_drafter("tree", target=target, draft=draft,
                            config=DraftConfig(tree_width=3, tree_depth=5, node_budget=7))
    drafter.begin(PROMPTS[1])
    tree = drafter.propose(PROMPTS[1], DraftRequest(max_depth=5))
    assert 1 <= len(tree) <= 7
    assert tree.max_depth <= 5
    for node, parent in enumerate(tree.parent_ids):
        assert parent < node
        siblings = [tree.token_ids[c] for c in tree.children[parent + 1]]
        assert len(siblings) == len(set(siblings)) <= 3
    # the draft cache is back at the context: tree nodes never leak into the next step
    assert drafter.runner.cache.get_seq_length() == len(PROMPTS[1])


def _mean_accepted_length(kind: str, config: DraftConfig) -> float:
    target, draft = target_model("llama"), noisy_copy("llama", 0.2)
    drafter = build_drafter(kind, target=target, draft=draft, config=config)
    decoder = SpeculativeDecoder(target, drafter)
    stats = GenerationStats()
    for prompt in PROMPTS:
        stats.merge(decoder.generate(prompt, GenerationConfig(max_new_tokens=48)).stats)
    return stats.mean_accepted_length


def test_tree_accepts_more_than_a_chain_of_the_same_node_budget():
    """With a draft that often ranks the target's token second, branching pays."""
    chain = _mean_accepted_length("draft_model", DraftConfig(length=6))
    tree = _mean_accepted_length("tree", DraftConfig(tree_width=3, tree_depth=6, node_budget=6))
    assert tree > 1.1 * chain
