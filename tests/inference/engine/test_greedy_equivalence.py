"""Greedy speculative decoding returns exactly the target's own greedy tokens.

Property tests over random prompts, every drafter, draft lengths 1-8, several tree shapes,
EOS inside a draft and max_new_tokens reached mid-draft, for GPT-2, Llama and Qwen2. The
drafts come from a noisy copy of the target (accepts about half the time, so both acceptance
and rejection paths run) or an unrelated random draft (rejects almost always).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.engine import (
    DraftConfig,
    GenerationConfig,
    SpeculativeDecoder,
    build_drafter,
)
from inference.engine.decode.target_only import generate_plain

from .conftest import ARCHS, VOCAB_SIZE, draft_model, noisy_copy, target_model

prompts = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=24)
PROPERTY_SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                             suppress_health_check=[HealthCheck.too_slow])


def _draft(arch: str, which: str):
    return noisy_copy(arch) if which == "noisy" else draft_model(arch)


def _check_equal(arch: str, kind: str, draft, config: DraftConfig, prompt: list[int],
                 generation: GenerationConfig) -> None:
    target = target_model(arch)
    expected = generate_plain(target, prompt, generation)
    decoder = SpeculativeDecoder(target, build_drafter(kind, target=target, draft=draft,
                                                       config=config))
    steps = list(decoder.stream(prompt, generation))
    tokens = [token for step in steps for token in step.token_ids]
    assert tokens == expected.token_ids
    assert steps[-1].finish_reason == expected.finish_reason
    assert all(step.finish_reason is None for step in steps[:-1])


@pytest.mark.parametrize("arch", ARCHS)
@PROPERTY_SETTINGS
@given(prompt=prompts, length=st.integers(1, 8), max_new=st.integers(1, 40),
       which=st.sampled_from(["noisy", "random"]))
def test_draft_model_matches_target_greedy(arch, prompt, length, max_new, which):
    _check_equal(arch, "draft_model", _draft(arch, which), DraftConfig(length=length), prompt,
                 GenerationConfig(max_new_tokens=max_new))


@pytest.mark.parametrize("arch", ARCHS)
@PROPERTY_SETTINGS
@given(prompt=prompts, width=st.integers(1, 4), depth=st.integers(1, 6),
       budget=st.integers(1, 16), max_new=st.integers(1, 40),
       which=st.sampled_from(["noisy", "random"]))
def test_tree_matches_target_greedy(arch, prompt, width, depth, budget, max_new, which):
    config = DraftConfig(tree_width=width, tree_depth=depth, node_budget=budget)
    _check_equal(arch, "tree", _draft(arch, which), config, prompt,
                 GenerationConfig(max_new_tokens=max_new))


@pytest.mark.parametrize("arch", ARCHS)
@PROPERTY_SETTINGS
@given(prompt=st.lists(st.integers(0, 7), min_size=1, max_size=30), length=st.integers(1, 8),
       ngram=st.integers(1, 4), max_new=st.integers(1, 40))
def test_ngram_matches_target_greedy(arch, prompt, length, ngram, max_new):
    # a small token range makes repeats, so the lookup finds matches
    config = DraftConfig(length=length, ngram_size=ngram)
    _check_equal(arch, "ngram", None, config, prompt, GenerationConfig(max_new_tokens=max_new))


@pytest.mark.parametrize("arch", ARCHS)
@PROPERTY_SETTINGS
@given(prompt=prompts, max_new=st.integers(1, 30))
def test_no_drafter_matches_target_greedy(arch, prompt, max_new):
    _check_equal(arch, "none", None, DraftConfig(), prompt, GenerationConfig(max_new_tokens=max_new))


@pytest.mark.parametrize("arch", ARCHS)
@PROPERTY_SETTINGS
@given(prompt=prompts, eos_at=st.integers(0, 29), length=st.integers(2, 8),
       kind=st.sampled_from(["draft_model", "tree"]))
def test_eos_inside_a_draft_stops_at_the_same_token(arch, prompt, eos_at, length, kind):
    """EOS is a token the target really emits, so it lands inside accepted drafts."""
    target = target_model(arch)
    free_run = generate_plain(target, prompt, GenerationConfig(max_new_tokens=30)).token_ids
    eos = free_run[min(eos_at, len(free_run) - 1)]
    generation = GenerationConfig(max_new_tokens=30, eos_token_id=eos)
    config = DraftConfig(length=length, tree_width=2, tree_depth=length, node_budget=2 * length)
    _check_equal(arch, kind, noisy_copy(arch), config, prompt, generation)
    expected = free_run[: free_run.index(eos) + 1]
    assert generate_plain(target, prompt, generation).token_ids == expected


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("adaptive", [False, True])
def test_adaptive_length_and_confidence_keep_greedy_output(arch, adaptive):
    config = DraftConfig(length=3, adaptive=adaptive, min_length=1, max_length=8,
                         confidence_threshold=0.3)
    for prompt in ([3, 1, 4, 1, 5], [9, 2, 6], list(range(20, 40))):
        _check_equal(arch, "draft_model", noisy_copy(arch), config, prompt,
                     GenerationConfig(max_new_tokens=48))
