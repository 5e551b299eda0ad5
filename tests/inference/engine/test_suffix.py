"""The suffix drafter: greedy output unchanged, sampling lossless, corpora bounded and apart.

The drafter proposes what followed the context's suffix in its own tokens and in one corpus of
earlier outputs. Whatever it proposes, greedy decoding must return the target's own greedy
tokens and sampling the target's distribution; a corpus must never leak into another key's
drafts; an index must stay within its bounds however much is fed to it; and with nothing to go
on it drafts nothing.
"""

from __future__ import annotations

import itertools
import random
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.engine import DRAFTERS, DraftConfig, GenerationConfig, SpeculativeDecoder, build_drafter
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.drafters.base import DraftRequest
from inference.engine.drafters.suffix import (
    MIN_PROBABILITY,
    SuffixCorpora,
    SuffixDrafter,
    SuffixIndex,
    frequency_tree,
    suffix_corpora,
)
from inference.engine.batch.policy import SpeculationPolicy
from inference.engine.decode.sampling import SamplingParams
from inference.engine.decode.target_only import generate_plain

from .chi_square import exact_joint, joint_p_value
from .conftest import ARCHS, VOCAB_SIZE, target_model

PROPERTY_SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                             suppress_health_check=[HealthCheck.too_slow])
_keys = itertools.count()


@pytest.fixture(autouse=True)
def empty_process_corpora():
    """The process-wide corpora (what build_drafter's drafters read) start and end empty."""
    suffix_corpora.clear()
    yield
    suffix_corpora.clear()


def _perturbed(tokens: list[int], flips: list[int]) -> list[int]:
    """`tokens` with the positions in `flips` changed: a corpus entry that is right in places."""
    changed = list(tokens)
    for position in flips:
        if position < len(changed):
            changed[position] = (changed[position] + 1) % VOCAB_SIZE
    return changed


# -- greedy: exactly the target's own tokens -----------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@PROPERTY_SETTINGS
@given(prompt=st.lists(st.integers(0, 11), min_size=1, max_size=24),
       flips=st.lists(st.integers(0, 40), max_size=4), noise=st.integers(0, 3),
       length=st.integers(1, 8), budget=st.integers(1, 16), max_new=st.integers(1, 40),
       seeded=st.booleans())
def test_greedy_output_is_the_targets_own_whatever_the_corpus_holds(arch, prompt, flips, noise,
                                                                    length, budget, max_new, seeded):
    target = target_model(arch)
    generation = GenerationConfig(max_new_tokens=max_new)
    expected = generate_plain(target, prompt, generation)
    key = ("tenant", next(_keys))
    rng = random.Random(len(prompt) * 31 + noise)
    if seeded:  # an earlier output of the same prompt, wrong at a few positions
        suffix_corpora.add(key, prompt[-8:] + _perturbed(expected.token_ids, flips))
    for _ in range(noise):  # and unrelated outputs sharing the small token range
        suffix_corpora.add(key, [rng.randrange(12) for _ in range(rng.randrange(3, 40))])
    drafter = build_drafter("suffix", target=target, corpus=key,
                            config=DraftConfig(length=length, node_budget=budget))
    steps = list(SpeculativeDecoder(target, drafter).stream(prompt, generation))
    assert [token for step in steps for token in step.token_ids] == expected.token_ids
    assert steps[-1].finish_reason == expected.finish_reason
    assert all(step.finish_reason is None for step in steps[:-1])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_corpus_holding_the_output_is_accepted_and_branches_verify_in_one_forward(arch):
    target = target_model(arch)
    prompt = [5, 17, 33, 2, 61, 8]
    generation = GenerationConfig(max_new_tokens=32, eos_token_id=())
    expected = generate_plain(target, prompt, generation).token_ids
    corpora = SuffixCorpora()
    corpora.add("a", prompt + expected)
    corpora.add("a", prompt + _perturbed(expected, [3, 9, 20]))  # siblings where they disagree
    decoder = SpeculativeDecoder(target, SuffixDrafter(DraftConfig(length=8, node_budget=16),
                                                       corpus="a", corpora=corpora))
    steps = list(decoder.stream(prompt, generation))
    assert [token for step in steps for token in step.token_ids] == expected
    assert decoder.stats.accepted >= len(expected) // 2
    assert len(steps) < len(expected) // 2
    assert any(len(step.branches) > 1 for step in steps)  # a real tree, not only chains


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_batched_suffix_rows_equal_the_targets_greedy_and_feed_the_next_ones(arch):
    """Rows of two corpora in one batch with other drafters; the second round drafts from the first."""
    target = target_model(arch)
    prompts = [[3, 9, 27, 81 % VOCAB_SIZE, 4], [10, 20, 30], [7, 7, 1, 2, 3, 4, 5], [50, 60]]
    generation = GenerationConfig(max_new_tokens=24, eos_token_id=())
    expected = [generate_plain(target, prompt, generation).token_ids for prompt in prompts]
    engine = BatchedSpeculativeEngine(target, None, decode=lambda ids: "", max_rows=3,
                                      prefill_chunk=4, policy=SpeculationPolicy(enabled=False))
    config = DraftConfig(length=6, node_budget=8)
    for round_no in range(2):
        requests = [BatchRequest((round_no, index), prompt, generation,
                                 "suffix" if index % 3 != 2 else "ngram", config,
                                 corpus=("tenant", index % 2))
                    for index, prompt in enumerate(prompts)]
        results = engine.run(requests, {(round_no, index): index for index in range(len(prompts))})
        for index, tokens in enumerate(expected):
            assert results[(round_no, index)].token_ids == tokens
            if round_no == 0 and requests[index].drafter == "suffix":
                suffix_corpora.add(("tenant", index % 2), prompts[index] + tokens)
        if round_no == 1:  # the suffix rows now find their own earlier outputs
            for index in (0, 1, 3):
                assert results[(1, index)].stats.accepted >= 12, index
    assert not engine.has_work()


# -- sampling: the target's distribution ------------------------------------------------------


SAMPLING_VOCAB = 8
SAMPLING_PROMPT = [3, 1, 4]


def test_sampled_output_follows_the_target_distribution_over_a_suffix_tree():
    """Unseeded sampling (a seeded run drafts from its own tokens only) with a branching corpus."""
    target = target_model("llama", vocab_size=SAMPLING_VOCAB)
    corpora = SuffixCorpora()
    for pair, times in (((2, 5), 3), ((2, 6), 2), ((7, 0), 2), ((5, 5), 1)):
        for _ in range(times):
            corpora.add("a", SAMPLING_PROMPT + list(pair))
    drafter = SuffixDrafter(DraftConfig(length=2, node_budget=8), corpus="a", corpora=corpora)
    tree = drafter.propose(SAMPLING_PROMPT, DraftRequest(2, SamplingParams(1.0)))
    assert len(tree.children[0]) == 3 and not tree.is_chain
    decoder = SpeculativeDecoder(target, drafter)
    torch.manual_seed(0)
    counts = np.zeros(SAMPLING_VOCAB * SAMPLING_VOCAB)
    drafted = accepted = 0
    for _ in range(2500):
        result = decoder.generate(SAMPLING_PROMPT, GenerationConfig(max_new_tokens=3, temperature=1.0,
                                                                   eos_token_id=()))
        counts[result.token_ids[0] * SAMPLING_VOCAB + result.token_ids[1]] += 1
        drafted += result.stats.drafted
        accepted += result.stats.accepted
    assert drafted > 0 and accepted > 0
    params = SamplingParams(1.0)
    assert joint_p_value(counts, exact_joint(target, SAMPLING_PROMPT, SAMPLING_VOCAB, params)) > 1e-3
    # negative control: a decoder that emitted the corpus' favourite would look nothing like it
    favourite = np.zeros(SAMPLING_VOCAB * SAMPLING_VOCAB)
    favourite[2 * SAMPLING_VOCAB + 5] = 1.0
    assert joint_p_value(counts, 0.5 * favourite + 0.5 / favourite.size) < 1e-6


def test_a_seeded_sampled_generation_ignores_the_corpus_so_its_seed_decides_its_tokens():
    target = target_model("qwen2")
    prompt = [4, 8, 15, 16, 23, 42]
    config = GenerationConfig(max_new_tokens=24, temperature=1.0, seed=7)
    corpora = SuffixCorpora()
    drafter = SuffixDrafter(DraftConfig(length=6), corpus="a", corpora=corpora)
    before = SpeculativeDecoder(target, drafter).generate(prompt, config).token_ids
    corpora.add("a", prompt + [9] * 30)
    corpora.add("a", prompt + before)
    assert SpeculativeDecoder(target, drafter).generate(prompt, config).token_ids == before
    tree = drafter.propose(prompt, DraftRequest(6, SamplingParams(1.0), torch.Generator()))
    assert len(tree) == 0  # the corpus is not read; the prompt repeats no anchor
    assert len(drafter.propose(prompt, DraftRequest(6))) > 0  # greedy reads it


# -- corpora apart, nothing from nothing ---------------------------------------------------------


@PROPERTY_SETTINGS
@given(context_tail=st.lists(st.integers(0, 9), min_size=0, max_size=12),
       a_len=st.integers(1, 30), b_len=st.integers(0, 30))
def test_a_drafter_never_proposes_what_only_another_corpus_holds(context_tail, a_len, b_len):
    """Tenant a's outputs use tokens 50-79, tenant b's 80-95; both follow the same anchor."""
    corpora = SuffixCorpora()
    anchor = [1, 2]
    corpora.add("a", anchor + [50 + i % 30 for i in range(a_len)])
    if b_len:
        corpora.add("b", anchor + [80 + i % 16 for i in range(b_len)])
    context = context_tail + anchor
    seen_in_context = set(context)
    for key, own_range in (("b", range(80, 96)), ("c", range(0))):
        tree = SuffixDrafter(DraftConfig(length=8, node_budget=16), corpus=key,
                             corpora=corpora).propose(context, DraftRequest(8))
        assert set(tree.token_ids) <= set(own_range) | seen_in_context, key
        assert not set(tree.token_ids) & set(range(50, 80))
    if 1 not in context_tail:  # else the context's own longer match may win: a's is found
        a_tree = SuffixDrafter(DraftConfig(length=8), corpus="a", corpora=corpora).propose(
            context, DraftRequest(8))
        assert a_tree.token_ids[:1] == [50]


def test_nothing_to_go_on_drafts_nothing():
    corpora = SuffixCorpora()
    request = DraftRequest(8)
    assert len(SuffixDrafter(DraftConfig(), corpus="a", corpora=corpora).propose([1, 2, 3, 4], request)) == 0
    assert "a" not in corpora  # reading a corpus does not create it
    corpora.add("a", [7, 8, 9, 10])
    drafter = SuffixDrafter(DraftConfig(), corpus="a", corpora=corpora)
    assert len(drafter.propose([1, 2, 3, 4], request)) == 0  # no anchor in common
    assert len(drafter.propose([5], request)) == 0  # shorter than an anchor
    assert len(drafter.propose([7, 8], DraftRequest(0))) == 0  # no depth asked for
    assert drafter.propose([7, 8], request).token_ids == [9, 10]
    assert len(SuffixDrafter(DraftConfig()).propose([1, 2, 3, 4, 5, 6], request)) == 0


def test_the_confidence_threshold_prunes_rare_continuations():
    continuations = [[1, 2, 3]] * 9 + [[4, 5, 6]]
    tree = frequency_tree(continuations, depth=3, node_budget=16, min_probability=0.2)
    assert tree.token_ids == [1, 2, 3] and tree.is_chain
    tree = frequency_tree(continuations, depth=3, node_budget=16, min_probability=MIN_PROBABILITY)
    assert sorted(tree.token_ids) == [1, 2, 3, 4, 5, 6] and len(tree.children[0]) == 2
    tree = frequency_tree(continuations, depth=2, node_budget=3, min_probability=MIN_PROBABILITY)
    assert tree.token_ids == [1, 2, 4]  # best first within the budget, never deeper than asked
    drafter = SuffixDrafter(DraftConfig(confidence_threshold=0.5))
    assert drafter.min_probability == 0.5


def test_a_longer_match_wins_over_a_more_recent_shorter_one():
    corpora = SuffixCorpora()
    corpora.add("a", [9, 8, 7, 1, 2, 40, 41])  # matches the context's last 5 tokens
    corpora.add("a", [0, 1, 2, 60, 61])  # newer, matches 2
    tree = SuffixDrafter(DraftConfig(length=4), corpus="a", corpora=corpora).propose(
        [9, 8, 7, 1, 2], DraftRequest(4))
    assert tree.token_ids == [40, 41]


# -- bounded memory ----------------------------------------------------------------------------


def test_an_index_stays_within_its_bounds_under_many_insertions():
    index = SuffixIndex(max_sequences=64, max_tokens=4096, max_occurrences=8)
    rng = random.Random(0)
    tracemalloc.start()
    try:
        for count in range(3000):
            index.add([rng.randrange(200) for _ in range(rng.randrange(3, 160))])
            if count == 999:
                after_1000 = tracemalloc.get_traced_memory()[0]
            assert len(index) <= 64 and index.token_count <= 4096
        after_3000 = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert index.entry_count <= index.token_count and index.key_count <= index.entry_count
    assert sum(len(s) for s in index._sequences) == index.token_count
    assert after_3000 < after_1000 * 1.25 + 64_000, (after_1000, after_3000)
    # one long sequence keeps only its tail
    index.add(list(range(10_000)))
    assert len(index) == 1 and index.token_count == 4096


def test_evicted_sequences_are_never_proposed_and_leave_no_occurrences():
    index = SuffixIndex(max_sequences=3, max_tokens=1000)
    index.add([1, 2, 70, 71, 72])
    assert index.match([1, 2], 4)[1] == [[70, 71, 72]]
    for offset in range(0, 30, 10):
        index.add([100 + offset, 101 + offset, 102 + offset, 103 + offset])
    assert index.match([1, 2], 4) == (0, [])
    assert index.key_count == 3 * 2  # two anchors per remaining 4-token sequence


def test_the_corpora_keep_the_most_recently_used_keys_only():
    corpora = SuffixCorpora(max_corpora=4, max_sequences=2, max_tokens=50)
    corpora.add("kept", [1, 2, 3])
    for key in range(20):
        corpora.add(key, [1, 2, key])
        corpora.index("kept")  # read every time: never the least recently used
        assert len(corpora) <= 4
    assert "kept" in corpora and 0 not in corpora and 19 in corpora


def test_the_registry_builds_it_with_its_parameters_and_corpus():
    kind = DRAFTERS["suffix"]
    assert kind.uses_corpus and not kind.needs_draft_model
    assert kind.parameter_names == ("draft_length", "node_budget")
    drafter = build_drafter("suffix", target=target_model("gpt2"), corpus=("t", 1),
                            config=kind.draft_config({"draft_length": 7, "node_budget": 12}))
    assert isinstance(drafter, SuffixDrafter) and drafter.name == "suffix"
    assert drafter.corpus == ("t", 1) and drafter.corpora is suffix_corpora
    assert (drafter.nominal_depth, drafter.config.node_budget) == (7, 12)
