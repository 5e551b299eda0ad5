"""A target whose vocabulary is padded past the draft's (Qwen2.5-7B: 152,064 logits, 0.5B: 151,936).

The target can emit an id the draft's embedding lacks; the draft must never be fed it (that was an
IndexError inside the draft's embedding), and greedy output stays exactly the target's. The
targets here put ids past the draft's vocabulary into their own greedy output on purpose: each
high id's output row is a slightly scaled copy of a token the target emits often, so the high
id wins wherever that token would have.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from inference.engine import (
    ConfigError,
    DraftConfig,
    GenerationConfig,
    SpeculativeDecoder,
    build_drafter,
    draftable_ids,
    generate_plain,
)
from inference.engine.drafters import DraftModelRunner
from inference.engine.lm.modeling import SUBSTITUTE_TOKEN_ID, logits_width

from .conftest import ARCHS, CONTEXT, VOCAB_SIZE, _build, draft_model

PADDED = VOCAB_SIZE + 8
PROMPTS = ([5, 17, 33, 2, 41, 8], [60, 61, 62, 3], [9] * 5, list(range(10, 40)))
NO_EOS = GenerationConfig(max_new_tokens=32, eos_token_id=())


@functools.cache
def padded_target(arch: str) -> torch.nn.Module:
    """A target with PADDED ids whose greedy output often holds ids >= VOCAB_SIZE."""
    model = _build(arch, 1, torch.float64, PADDED, 64, 2, CONTEXT, logit_scale=8.0)
    emitted = Counter(token for prompt in PROMPTS
                      for token in generate_plain(model, prompt, NO_EOS).token_ids)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        for high, (source, _) in zip(range(VOCAB_SIZE, PADDED), emitted.most_common()):
            head[high] = head[source] * 1.1
    return model


@functools.cache
def truncated_copy(arch: str) -> torch.nn.Module:
    """The padded target cut to VOCAB_SIZE ids: a draft that agrees except on the high ids."""
    draft = _build(arch, 1, torch.float64, VOCAB_SIZE, 64, 2, CONTEXT, logit_scale=8.0)
    source = padded_target(arch).state_dict()
    with torch.no_grad():
        for name, parameter in draft.state_dict().items():
            parameter.copy_(source[name][tuple(slice(0, size) for size in parameter.shape)])
    return draft


def test_draftable_ids_substitutes_only_what_the_draft_lacks():
    assert draftable_ids([3, 95, 96, 101, 4], 96) == [3, 95, SUBSTITUTE_TOKEN_ID, SUBSTITUTE_TOKEN_ID, 4]
    assert draftable_ids([3, 99], 96, substitute=7) == [3, 7]
    ids = [1, 2, 3]
    assert draftable_ids(ids, 96) is ids  # nothing to do, nothing copied
    assert draftable_ids([], 96) == []


def test_the_padded_targets_emit_ids_the_draft_lacks():
    for arch in ARCHS:
        target = padded_target(arch)
        assert logits_width(target) == PADDED and truncated_copy(arch).get_input_embeddings().num_embeddings == VOCAB_SIZE
        emitted = [token for prompt in PROMPTS for token in generate_plain(target, prompt, NO_EOS).token_ids]
        assert sum(token >= VOCAB_SIZE for token in emitted) >= 5, arch


@functools.cache
def target_greedy(arch: str, prompt: tuple[int, ...], generation: GenerationConfig):
    return generate_plain(padded_target(arch), list(prompt), generation)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("kind", "config", "which"), [
    ("draft_model", DraftConfig(length=4), "truncated"),
    ("draft_model", DraftConfig(length=4), "random"),
    ("draft_model", DraftConfig(length=3, adaptive=True, min_length=1, max_length=6), "truncated"),
    ("tree", DraftConfig(tree_width=2, tree_depth=3, node_budget=6), "truncated"),
    ("tree", DraftConfig(tree_width=2, tree_depth=3, node_budget=6), "random"),
    ("ngram", DraftConfig(length=4, ngram_size=2), None),
])
def test_greedy_output_is_the_target_s_when_it_emits_ids_the_draft_lacks(arch, kind, config, which):
    target = padded_target(arch)
    draft = truncated_copy(arch) if which == "truncated" else draft_model(arch)
    decoder = SpeculativeDecoder(target, build_drafter(kind, target=target, draft=draft, config=config))
    accepted = 0
    for prompt in PROMPTS:
        for generation in (NO_EOS, GenerationConfig(max_new_tokens=32)):
            expected = target_greedy(arch, tuple(prompt), generation)
            result = decoder.generate(prompt, generation)
            assert result.token_ids == expected.token_ids
            assert result.finish_reason == expected.finish_reason
            accepted += result.stats.accepted
    if which == "truncated":
        assert accepted > 0  # the draft keeps drafting well around the substituted positions


def test_sampling_with_a_padded_target_runs_and_stays_in_the_target_vocabulary():
    target = padded_target("qwen2")
    decoder = SpeculativeDecoder(target, build_drafter("tree", target, truncated_copy("qwen2")))
    config = GenerationConfig(max_new_tokens=48, temperature=1.0, seed=3, eos_token_id=())
    tokens = [t for prompt in PROMPTS for t in decoder.generate(prompt, config).token_ids]
    assert all(0 <= token < PADDED for token in tokens)


def test_the_runner_feeds_the_substitute_but_keeps_the_real_context():
    target, draft = padded_target("llama"), truncated_copy("llama")
    runner = DraftModelRunner(draft, logits_width(target))
    context = [5, 17, VOCAB_SIZE + 2, 33]
    with torch.inference_mode():
        logits = runner.sync(context)
        assert runner.cached_ids == context and logits.shape == (PADDED,)
        assert torch.isinf(logits[VOCAB_SIZE:]).all()  # the draft never proposes an id it lacks
        runner.reset()
        substituted = runner.sync(draftable_ids(context, VOCAB_SIZE))
    assert torch.equal(logits, substituted)


def test_prompt_ids_are_checked_against_both_models():
    target = padded_target("gpt2")
    prompt = [5, VOCAB_SIZE + 1, 7]
    drafted = SpeculativeDecoder(target, build_drafter("draft_model", target, truncated_copy("gpt2")))
    with pytest.raises(ConfigError, match=rf"prompt_ids: .*\[0, {VOCAB_SIZE}\).*draft"):
        drafted.generate(prompt, NO_EOS)
    with pytest.raises(ConfigError, match=rf"prompt_ids: .*\[0, {PADDED}\)"):
        drafted.generate([5, PADDED], NO_EOS)
    # without a draft model the target reads every id it has
    target_only = SpeculativeDecoder(target, build_drafter("ngram", target))
    assert target_only.generate(prompt, NO_EOS).token_ids == generate_plain(target, prompt, NO_EOS).token_ids
