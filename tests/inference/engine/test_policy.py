"""The speculation policy drafts where it pays and stops where it would cost throughput."""

from __future__ import annotations

import random

import pytest

from inference.engine.batch.policy import (
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


def test_cost_model_of_a_lone_sequence_is_not_a_per_token_extrapolation():
    # one row at a time (rows never vary: the `1` and `rows` columns are equal) with the costs
    # measured on the demo pair: decode steps, a few verifies and prompt prefills
    true_ms = {1: 5.96, 2: 6.47, 9: 8.23, 56: 17.24}
    costs = ForwardCostModel()
    for _ in range(20):
        for tokens, ms in true_ms.items():
            costs.observe(1, tokens, ms / 1000)
    for tokens, ms in true_ms.items():
        assert costs.estimate(1, tokens) * 1000 == pytest.approx(ms, rel=0.15), tokens
    assert costs.estimate(1, 5) < 1.5 * costs.estimate(1, 1)


def test_a_policy_that_has_seen_only_decode_steps_and_prefills_still_drafts():
    # the deadlock this guards against: a 5-token verify estimated at 5x a decode step, so the
    # policy never drafted and never measured a verify
    policy = SpeculationPolicy(max_depth=8)
    for _ in range(50):
        policy.target_costs.observe(1, 1, 0.006)
        policy.draft_costs.observe(1, 1, 0.0004)
    assert policy.decide([RowOutlook("draft_model", 8)]).depth > 0  # one size seen: optimistic
    policy.target_costs.observe(1, 56, 0.017)
    policy.draft_costs.observe(1, 48, 0.002)
    decision = policy.decide([RowOutlook("draft_model", 8)])
    assert decision.depth >= 3
    assert policy.target_costs.estimate(1, 5) < 0.008


def test_a_cost_model_fitted_on_one_batch_size_does_not_underestimate_another():
    # a warm-up that only ran 8-row steps (overhead 5 ms, 0.3 ms a row, 0.2 ms a row-token):
    # the overhead must not be handed to a per-row term it cannot tell apart from
    costs = ForwardCostModel()
    for tokens in (1, 5, 9, 48):
        costs.observe(8, tokens, (5.0 + 0.3 * 8 + 0.2 * 8 * tokens) / 1000)
    assert costs.estimate(1, 1) * 1000 >= 5.0  # the old fit said 1.2 ms
    assert costs.estimate(8, 3) * 1000 == pytest.approx(5.0 + 2.4 + 4.8, rel=1e-6)


def test_a_cold_outlier_does_not_make_a_lone_rows_draft_look_expensive():
    # the draft forwards a c=8 warm-up measured on the demo pair (one of them cold), then a lone
    # request: the old fit (clamped least squares) put 105 ms on each row, so one row's 1.6 ms
    # draft forward looked like 106 ms and the policy never drafted again
    draft = ForwardCostModel()
    draft.observe(5, 56, 0.0208)
    for _ in range(5):
        draft.observe(8, 1, 0.0028)
    draft.observe(8, 3, 0.0224)
    assert draft.estimate(1, 1) <= 0.0028  # at most what 8 rows x 1 token was measured at
    assert draft.estimate(8, 2) <= 0.0224
    assert all(coefficient >= 0 for coefficient in draft._coefficients)

    policy = SpeculationPolicy(max_depth=8)
    policy.draft_costs = draft
    for _ in range(20):
        policy.target_costs.observe(1, 1, 0.0137)
        policy.target_costs.observe(1, 5, 0.0153)
    for _ in range(100):
        policy.observe_acceptance("draft_model", 8, 4)
    assert policy.decide([RowOutlook("draft_model", 8)]).depth >= 3


def test_a_one_off_slow_forward_does_not_stop_a_lone_row_from_drafting():
    # a warm-up at 8 rows whose first verify also measured the machine's matrix kernels (150 ms
    # instead of ~24), then lone decode steps: fitted on raw observations, the outlier put the
    # cost on every row-token, a lone 5-token verify looked 2.5x a decode step and the policy
    # at one row never drafted (seen in bench/serving.py: spec_batch at c=1 = plain_batch)
    policy = SpeculationPolicy(max_depth=8)
    for seconds in (0.150, 0.024, 0.023, 0.024):
        policy.target_costs.observe(8, 5, seconds)
        policy.draft_costs.observe(8, 1, 0.0011)
    for _ in range(40):
        policy.target_costs.observe(1, 1, 0.0076)
        policy.draft_costs.observe(1, 1, 0.0006)
    assert policy.target_costs.estimate(1, 5) < 1.5 * policy.target_costs.estimate(1, 1)
    for _ in range(100):
        policy.observe_acceptance("draft_model", 8, 4)
    assert policy.decide([RowOutlook("draft_model", 8)]).depth >= 3


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
