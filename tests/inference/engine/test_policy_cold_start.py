"""A fresh engine speculates from its first request (issue 25: it used to sit at "don't draft").

A new engine's policy knew nothing of the draft's cost: it assumed a draft forward cost a
millisecond whatever the models, so against a target forward of about that the first step chose
depth 0, no draft forward ran, and the guess was never corrected (a fresh `make run`: 95 of 96
steps of the first greedy generation undrafted). The engine now profiles a cost table when it
is built, and a policy that keeps choosing 0 drafts now and then to measure again (soon at
first, then less and less often).

The pair here makes drafting pay without doubt: a 12-layer target whose layers after the first
add nothing to the residual stream, and its 1-layer copy as the draft, so the draft's logits are
the target's (every draft token is accepted) at a fraction of a target forward's cost.
"""

from __future__ import annotations

import functools

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from inference.engine import GenerationConfig
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.batch.policy import RowOutlook, SpeculationPolicy
from inference.engine.decode.target_only import generate_plain

from .conftest import CONTEXT, VOCAB_SIZE

TARGET_LAYERS = 12


def _config(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=CONTEXT, bos_token_id=0, eos_token_id=1,
                       tie_word_embeddings=False)


@functools.cache
def agreeing_pair() -> tuple[PreTrainedModel, PreTrainedModel]:
    """(target, draft): the draft computes the target's logits exactly, with 1 layer of 12."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        target = LlamaForCausalLM._from_config(_config(TARGET_LAYERS), attn_implementation="sdpa")
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # sharp outputs, as in conftest
        for layer in target.model.layers[1:]:
            # attention and MLP outputs of zero: the layer passes its input through unchanged
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    draft = LlamaForCausalLM._from_config(_config(1), attn_implementation="sdpa")
    draft.load_state_dict({name: weights for name, weights in target.state_dict().items()
                           if not name.startswith("model.layers.") or name.startswith("model.layers.0.")})
    return target.eval(), draft.eval()


def test_the_pair_agrees_exactly_and_the_draft_is_cheaper():
    target, draft = agreeing_pair()
    ids = torch.tensor([[5, 9, 2, 7, 3]])
    with torch.inference_mode():
        assert torch.equal(target(ids).logits, draft(ids).logits)
    engine = BatchedSpeculativeEngine(target, draft, decode=lambda ids: "")
    policy = engine.policy
    # the profile measured both models before any request, and wrote nothing to the step log
    assert policy.draft_costs.observations and policy.target_costs.observations
    assert engine.forward_log == []
    assert policy.draft_costs.estimate(1, 1) < policy.target_costs.estimate(1, 1) / 2


def test_a_fresh_engine_drafts_from_its_first_decode_step():
    target, draft = agreeing_pair()
    engine = BatchedSpeculativeEngine(target, draft, decode=lambda ids: "")
    prompt = [5, 9, 2, 7, 3, 8]
    config = GenerationConfig(max_new_tokens=40, eos_token_id=())
    engine.submit(BatchRequest("first", prompt, config, "draft_model"))
    tokens, drafted = [], []
    while engine.has_work():
        events = engine.step()
        tokens += [token for event in events for token in event.step.token_ids]
        if engine.last_step_timing.rows:  # a decode step (not the prefill lane's)
            drafted += [event.step.drafted for event in events]
    # the lane's prefill step gives the first token undrafted; every decode step after it is
    # a decision of the policy, and the very first one already drafts (the old policy chose 0
    # there whatever the models: two forwards it had not measured, a millisecond each)
    assert drafted[0] > 0, drafted
    assert sum(1 for count in drafted if count > 0) >= 0.8 * len(drafted), drafted
    assert tokens == generate_plain(target, prompt, config).token_ids  # greedy output unchanged


def _compute_bound_policy(explore_after: int | None) -> SpeculationPolicy:
    """A policy that has measured every extra token costing as much as a decode step."""
    policy = SpeculationPolicy(max_depth=4, explore_after=explore_after)
    for rows in (1, 8):
        for tokens in (1, 5):
            policy.target_costs.observe(rows, tokens, 0.002 * rows * tokens)
            policy.draft_costs.observe(rows, tokens, 0.001 * rows * tokens)
    return policy


def test_a_policy_that_keeps_choosing_no_draft_drafts_again_now_and_then():
    outlooks = [RowOutlook("draft_model", 4)] * 8
    policy = _compute_bound_policy(explore_after=4)
    decisions = [policy.decide(outlooks) for _ in range(300)]
    explored = [index for index, decision in enumerate(decisions) if decision.depth]
    # the 4th decision explores, then the 8th after it, the 16th, 32nd, 64th, 64th: a misjudgment
    # is measured again at once, a batch where drafting truly loses pays for one step in 64
    assert explored == [3, 11, 27, 59, 123, 187, 251]
    assert all(decisions[index].explored for index in explored)
    assert not any(decision.explored for decision in decisions if decision.depth == 0)
    # a depth chosen on its merits starts the waits over
    lone = policy.decide([RowOutlook("draft_model", 4)], width=5)  # the forward is 5 wide anyway
    assert lone.depth and not lone.explored
    assert [policy.decide(outlooks).depth > 0 for _ in range(4)] == [False, False, False, True]
    never = _compute_bound_policy(explore_after=None)
    assert all(never.decide(outlooks).depth == 0 for _ in range(100))
