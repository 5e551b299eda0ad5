"""Sampling under a constraint emits the grammar-masked target's distribution exactly.

The constraint is an integer in [0, 99]: the first two tokens are digits, EOS or the end of
the output, so the masked target's exact joint distribution of (first token, second token or
end) comes from 1 + a few forwards and the matcher; a chi-square test compares it with the
counts of many seeded speculative generations (as test_sampling_distribution.py does without a
constraint). The negative control is the draft model masked the same way: the counts must be far from it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference.engine import DraftConfig, GenerationConfig, SpeculativeDecoder, build_drafter
from inference.engine.constraints import OutputConstraint, new_matcher
from inference.engine.decode.sampling import SamplingParams, warp_probs

from .chi_square import joint_p_value
from .constraint_models import VOCAB, json_tokenizer, models, prompt_ids

# 1,200 runs over the 44 cells left after pooling reject a deviation of w >= 0.25 at p < 1e-3
# with power 0.99, below the residual bug's 0.27 in the first token alone (more in the joint) and
# the masked draft's 9.5 (chi_square.py); 2,000 resolved w >= 0.20 at 1.7x the CPU.
RUNS = 1200
P_VALUE_FLOOR = 1e-3
END = VOCAB  # the second cell of a generation that ended after one token
CONSTRAINT = OutputConstraint.json_schema({"type": "integer", "minimum": 0, "maximum": 99})


def _matcher():
    return new_matcher(json_tokenizer(), VOCAB, CONSTRAINT, (json_tokenizer().eos_token_id,))


def _masked_probs(model, context: list[int], matcher, params: SamplingParams) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([context])).logits[0, -1:]
    return warp_probs(logits.masked_fill(~matcher.allowed()[None], float("-inf")), params)[0]


def exact_masked_joint(model, params: SamplingParams) -> np.ndarray:
    """P(first, second-or-END) of the target masked by the grammar, flattened [VOCAB * (VOCAB + 1)]."""
    matcher, prompt = _matcher(), prompt_ids()
    joint = np.zeros((VOCAB, VOCAB + 1))
    first = _masked_probs(model, prompt, matcher, params)
    for token in first.nonzero().flatten().tolist():
        matcher.advance([token])
        if matcher.is_stopped:
            joint[token, END] = float(first[token])
        else:
            joint[token, :VOCAB] = float(first[token]) * _masked_probs(
                model, prompt + [token], matcher, params).double().numpy()
        matcher.rollback(1)
    return joint.ravel()


def _counts(decoder: SpeculativeDecoder, temperature: float) -> np.ndarray:
    counts = np.zeros(VOCAB * (VOCAB + 1))
    for seed in range(RUNS):
        tokens = decoder.generate(prompt_ids(), GenerationConfig(
            max_new_tokens=3, temperature=temperature, seed=seed,
            eos_token_id=json_tokenizer().eos_token_id, constraint=CONSTRAINT)).token_ids
        counts[tokens[0] * (VOCAB + 1) + (tokens[1] if len(tokens) > 1 else END)] += 1
    return counts


@pytest.mark.parametrize(("kind", "config"), [
    ("draft_model", DraftConfig(length=2)),
    ("tree", DraftConfig(tree_width=3, tree_depth=2, node_budget=6)),
])
def test_constrained_sampling_follows_the_masked_target(kind, config):
    target, draft, _ = models()
    decoder = SpeculativeDecoder(target, build_drafter(kind, target=target, draft=draft, config=config),
                                 tokenizer=json_tokenizer())
    counts = _counts(decoder, temperature=1.0)
    params = SamplingParams(1.0)
    assert decoder.stats.drafted > 0
    assert joint_p_value(counts, exact_masked_joint(target, params)) > P_VALUE_FLOOR
    # negative control: the draft model's own masked distribution is far from what was emitted
    assert joint_p_value(counts, exact_masked_joint(draft, params)) < 1e-6


@pytest.mark.parametrize("drafter", ["draft_model", "tree"])
def test_constrained_sampling_in_the_batched_engine_follows_the_masked_target(drafter):
    """The same check with every generation a row of one batched engine (16 rows at a time)."""
    from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
    from inference.engine.lm.loading import LoadedModel

    from .constraint_models import CONTEXT

    target, draft, _ = models()
    engine = BatchedSpeculativeEngine(LoadedModel(target, json_tokenizer(), CONTEXT, None),
                                      LoadedModel(draft, json_tokenizer(), CONTEXT, None))
    config = dict(max_new_tokens=3, temperature=1.0, eos_token_id=json_tokenizer().eos_token_id,
                  constraint=CONSTRAINT)
    results = engine.run([BatchRequest(seed, prompt_ids(), GenerationConfig(seed=seed, **config),
                                       drafter=drafter, draft_config=DraftConfig(length=2))
                          for seed in range(RUNS)])
    counts = np.zeros(VOCAB * (VOCAB + 1))
    for result in results.values():
        tokens = result.token_ids
        counts[tokens[0] * (VOCAB + 1) + (tokens[1] if len(tokens) > 1 else END)] += 1
    assert sum(result.stats.drafted for result in results.values()) > 0
    params = SamplingParams(1.0)
    assert joint_p_value(counts, exact_masked_joint(target, params)) > P_VALUE_FLOOR
    assert joint_p_value(counts, exact_masked_joint(draft, params)) < 1e-6
