"""The speculation policy drafts where it pays and stops where it would cost throughput."""

from __future__ import annotations

import random

import pytest

from inference.engine.policy import (
    AcceptanceTracker,
    ForwardCostModel,
    RowOutlook,
    SpeculationPolicy,
)


def _policy(fixed_ms: float, per_token_ms: float, acceptance: float) -> SpeculationPolicy:
    """A policy that has measured forwards costing fixed + per_token x rows x tokens."""
    policy = SpeculationPolicy(max_depth=8)
    for rows in (1, 2, 4, 8, 16, 32):
        for tokens in (1, 2, 4, 8):
            seconds = (fixed_ms + per_token_ms * rows * tokens) / 1000
            policy.target_costs.observe(rows, tokens, seconds)
            policy.draft_costs.observe(rows, tokens, seconds / 20)
    draws = random.Random(0)
    for _ in range(400):  # a drafter whose every position is accepted with `acceptance`
        accepted = 0
        while accepted < 8 and draws.random() < acceptance:
            accepted += 1
        policy.observe_acceptance("draft_model", 8, accepted)
    return policy


def test_cost_model_recovers_a_linear_cost():
    costs = ForwardCostModel()
    for rows in (1, 3, 8):
        for tokens in (1, 5):
            costs.observe(rows, tokens, 0.002 + 0.0005 * rows + 0.001 * rows * tokens)
    assert costs.estimate(16, 2) == pytest.approx(0.002 + 0.008 + 0.032, rel=1e-6)


def test_acceptance_tracker_learns_per_position_rates():
    tracker = AcceptanceTracker(prior=0.5)
    for _ in range(300):
        tracker.observe(depth=4, accepted=2)  # positions 1, 2 accepted; 3 rejected every time
    assert tracker.rate(0) > 0.95 and tracker.rate(1) > 0.95
    assert tracker.rate(2) < 0.05
    assert tracker.expected_tokens(2) == pytest.approx(3.0, abs=0.1)
    assert tracker.expected_tokens(4) == pytest.approx(tracker.expected_tokens(2), abs=0.1)


def test_speculation_switches_off_when_the_forward_is_compute_bound():
    # every token costs the same whatever the batch: drafting can only lose at acceptance 0.5
    policy = _policy(fixed_ms=0.0, per_token_ms=1.0, acceptance=0.5)
    decision = policy.decide([RowOutlook("draft_model", 8)] * 16)
    assert decision.depth == 0


def test_speculation_pays_on_a_lone_sequence_with_cheap_extra_tokens():
    # a GPU-like forward: a large fixed cost, tokens almost free
    policy = _policy(fixed_ms=10.0, per_token_ms=0.05, acceptance=0.8)
    assert policy.decide([RowOutlook("draft_model", 8)]).depth >= 3


def test_depth_shrinks_as_the_batch_grows_and_comes_back_when_it_shrinks():
    policy = _policy(fixed_ms=6.0, per_token_ms=0.4, acceptance=0.7)
    depths = [policy.decide([RowOutlook("draft_model", 8)] * rows).depth for rows in (1, 4, 16, 32)]
    assert depths == sorted(depths, reverse=True)
    assert depths[0] > depths[-1]
    assert policy.decide([RowOutlook("draft_model", 8)]).depth == depths[0]


def test_a_row_near_its_limit_caps_the_depth_it_counts():
    policy = _policy(fixed_ms=10.0, per_token_ms=0.05, acceptance=0.9)
    decision = policy.decide([RowOutlook("draft_model", 1)])
    assert decision.depth == 1


def test_disabled_policy_always_drafts_the_deepest_allowed():
    policy = SpeculationPolicy(max_depth=5, enabled=False)
    assert policy.decide([RowOutlook("draft_model", 8)] * 64).depth == 5


def test_auto_prefers_the_drafter_that_is_being_accepted():
    policy = _policy(fixed_ms=10.0, per_token_ms=0.05, acceptance=0.9)
    for _ in range(400):
        policy.observe_acceptance("ngram", 6, 0)
    assert policy.choose_drafter(["draft_model", "ngram", "none"], rows=1) == "draft_model"
