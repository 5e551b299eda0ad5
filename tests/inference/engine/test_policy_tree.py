"""The policy chooses a tree over a chain only where its extra acceptance pays for its wider verify."""

from __future__ import annotations

import random

from inference.engine.batch.policy import RowOutlook, SpeculationPolicy


def _costs(policy: SpeculationPolicy, fixed_ms: float, per_token_ms: float) -> None:
    for rows in (1, 2, 4, 8):
        for tokens in (1, 2, 5, 9, 17):
            seconds = (fixed_ms + per_token_ms * rows * tokens) / 1000
            policy.target_costs.observe(rows, tokens, seconds)
            policy.draft_costs.observe(rows, tokens, seconds / 20)
    policy.row_draft_seconds["tree"] = policy.draft_costs.estimate(1, 2)


def _accept(policy: SpeculationPolicy, drafter: str, rate: float, sampled: bool) -> None:
    draws = random.Random(0)
    for _ in range(400):
        accepted = 0
        while accepted < 8 and draws.random() < rate:
            accepted += 1
        policy.observe_acceptance(drafter, 8, accepted, sampled=sampled)


def _policy(fixed_ms: float, per_token_ms: float, chain: float, tree: float,
            sampled: bool) -> SpeculationPolicy:
    policy = SpeculationPolicy(max_depth=8)
    _costs(policy, fixed_ms, per_token_ms)
    _accept(policy, "draft_model", chain, sampled)
    _accept(policy, "tree", tree, sampled)
    return policy


def test_sampled_rows_choose_the_tree_where_it_is_accepted_much_more():
    # a weak draft under sampling (chain 0.55, tree 0.8), forwards cheap per extra token
    policy = _policy(fixed_ms=6.0, per_token_ms=0.2, chain=0.55, tree=0.8, sampled=True)
    assert policy.choose_drafter(["draft_model", "tree"], rows=1, depth=8, sampled=True,
                                 node_budget=16) == "tree"


def test_the_chain_stays_where_the_tree_gains_little_and_nodes_cost_compute():
    # greedy on a close pair (tree no better), a forward compute-bound per token
    policy = _policy(fixed_ms=2.0, per_token_ms=1.0, chain=0.85, tree=0.86, sampled=False)
    assert policy.choose_drafter(["draft_model", "tree"], rows=1, depth=8,
                                 node_budget=16) == "draft_model"


def test_greedy_and_sampled_acceptance_are_tracked_apart():
    policy = SpeculationPolicy()
    _costs(policy, fixed_ms=6.0, per_token_ms=0.2)
    _accept(policy, "tree", 0.9, sampled=True)
    assert policy.tracker("tree", sampled=True).rate(0) > 0.85
    assert policy.tracker("tree").rate(0) == policy.tracker("tree").prior
    decision_greedy = policy.decide([RowOutlook("tree", 8)])
    decision_sampled = policy.decide([RowOutlook("tree", 8, sampled=True)])
    assert decision_sampled.expected_tokens > decision_greedy.expected_tokens
