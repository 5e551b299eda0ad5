"""The static-shape forward path (engine/runner/, kv/static_ragged.py), run eagerly.

A `StaticRaggedCache` must be a drop-in for `RaggedCache`: the same logits for the same rows,
holes, trees and sliding windows, and an engine on it must give every row exactly what the row
gives alone. These tests run the static forward as plain PyTorch (no package store); the
compiled packages are tested in test_compiled_forward.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import MistralConfig, MistralForCausalLM

from inference.engine import DraftConfig, GenerationConfig, SpeculativeDecoder, build_drafter
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.batch.policy import SpeculationPolicy
from inference.engine.batch.runners import CompileSettings
from inference.engine.decode.target_only import generate_plain
from inference.engine.errors import ConfigError
from inference.engine.kv.prefix_cache import PrefixCache
from inference.engine.kv.ragged import RaggedCache, RowInput
from inference.engine.kv.static_ragged import StaticRaggedCache
from inference.engine.runner.kv_pool import KVPool, PoolShape, pool_rows_within
from inference.engine.runner.model_runner import ModelRunner
from inference.engine.runner.static_forward import static_forward_refusal

from .conftest import VOCAB_SIZE, noisy_copy, target_model

STATIC = CompileSettings(mode="auto")  # static pools and the static forward, nothing compiled
FAMILIES = ("llama", "qwen2", "qwen3")


def _decode(tokens: list[int]) -> str:
    return "".join(f"<{token}>" for token in tokens)


def windowed_model(window: int = 6) -> torch.nn.Module:
    """A tiny Mistral whose every layer slides over `window` positions."""
    config = MistralConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           sliding_window=window, bos_token_id=0, eos_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = MistralForCausalLM._from_config(config, attn_implementation="sdpa")
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
    return model.to(torch.float64).eval()


def _static_cache(model) -> StaticRaggedCache:
    return StaticRaggedCache(ModelRunner(model, pool_rows=4, capacity=192, max_tokens=64))


def _random_rows(generator: random.Random, rows: int) -> list[list[int]]:
    return [[generator.randrange(2, VOCAB_SIZE) for _ in range(generator.randrange(1, 20))] for _ in range(rows)]


@pytest.mark.parametrize("family", [*FAMILIES, "mistral-window"])
def test_static_cache_gives_the_ragged_caches_logits_with_holes_and_trees(family):
    """Prompts of different lengths, a tree with branches, rejected nodes turned into holes, rows
    leaving: every forward's logits equal the growing cache's (float64, to rounding)."""
    model = windowed_model() if family == "mistral-window" else target_model(family)
    generator = random.Random(0)
    ragged, static = RaggedCache(model), _static_cache(model)
    prompts = _random_rows(generator, 3)
    for cache in (ragged, static):
        for _ in prompts:
            cache.add_row()
    inputs = [RowInput(prompt, list(range(len(prompt)))) for prompt in prompts]
    for expected, got in zip(ragged.forward(inputs), static.forward(inputs)):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    # a tree per row: a pending token and three nodes, node 2 a sibling of node 1
    tree_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    steps = []
    for row, prompt in enumerate(prompts):
        start = len(prompt)
        tokens = [generator.randrange(2, VOCAB_SIZE) for _ in range(4)]
        steps.append(RowInput(tokens, [start, start + 1, start + 2, start + 1], tree_mask))
    for expected, got in zip(ragged.forward(steps), static.forward(steps)):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    for cache in (ragged, static):
        for row in range(3):  # keep the pending token and one branch: the rest become holes
            cache.drop(row, [cache.last_start + 2, cache.last_start + 3] if row % 2 else [cache.last_start + 1])
        cache.keep_rows([2, 0])
    follow = [RowInput([5], [len(prompts[2]) + 2]), RowInput([7, 9], [len(prompts[0]) + 3, len(prompts[0]) + 4])]
    for expected, got in zip(ragged.forward(follow), static.forward(follow)):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    static.compact()
    ragged.compact()
    last = [RowInput([11], [len(prompts[2]) + 3]), RowInput([13], [len(prompts[0]) + 5])]
    for expected, got in zip(ragged.forward(last), static.forward(last)):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_a_prefix_moves_between_static_caches_and_the_prefix_cache_format():
    model = target_model("llama")
    source, other = _static_cache(model), _static_cache(model)
    prompt = list(range(2, 30))
    source.add_row()
    source.forward([RowInput(prompt, list(range(len(prompt))))], logits="none")
    layers = source.row_prefix(0, 16)
    assert len(layers) == model.config.num_hidden_layers and layers[0][0].shape[1] == 16
    other.add_row_with(layers, 16)
    assert other.lengths() == [16]
    rest = RowInput(prompt[16:], list(range(16, len(prompt))))
    expected = source.forward([RowInput([3], [len(prompt)])])[0]
    other.forward([rest], logits="none")
    torch.testing.assert_close(other.forward([RowInput([3], [len(prompt)])])[0], expected, rtol=1e-9, atol=1e-9)


PROPERTY = settings(max_examples=6, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def _batches(draw):
    requests, arrivals = [], {}
    for index in range(draw(st.integers(2, 6))):
        prompt = draw(st.lists(st.integers(2, VOCAB_SIZE - 1), min_size=1, max_size=30))
        config = GenerationConfig(max_new_tokens=draw(st.integers(1, 20)),
                                  eos_token_id=draw(st.sampled_from([None, 1])))
        draft = DraftConfig(length=draw(st.integers(1, 6)), tree_width=draw(st.integers(1, 3)),
                            tree_depth=draw(st.integers(1, 4)), node_budget=draw(st.integers(1, 8)))
        kind = draw(st.sampled_from(["draft_model", "ngram", "tree", "suffix", "none"]))
        requests.append(BatchRequest(index, prompt, config, kind, draft))
        arrivals[index] = draw(st.integers(0, 5))
    return requests, arrivals


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@PROPERTY
@given(batch=_batches(), max_rows=st.integers(1, 4), prefill=st.sampled_from(["shared", "separate"]),
       policy_on=st.booleans())
def test_greedy_rows_on_static_pools_equal_the_targets_own_greedy_output(family, batch, max_rows, prefill, policy_on):
    requests, arrivals = batch
    target = target_model(family)
    engine = BatchedSpeculativeEngine(target, noisy_copy(family), decode=_decode, max_rows=max_rows, prefill=prefill,
                                      policy=SpeculationPolicy(enabled=policy_on), compile=STATIC)
    assert isinstance(engine.target_cache, StaticRaggedCache) and isinstance(engine.draft_cache, StaticRaggedCache)
    results = engine.run(requests, arrivals)
    for request in requests:
        expected = generate_plain(target, request.prompt_ids, request.config, decode=_decode)
        assert results[request.request_id].token_ids == expected.token_ids, (request.request_id, request.drafter)
    assert engine.runners.target.stats.forwards["eager"] > 0


def test_a_seeded_sampled_row_on_static_pools_gives_its_tokens_alone():
    target, draft = target_model("llama"), noisy_copy("llama")
    requests = [BatchRequest(index, [3 + index, 9, 27, 4], GenerationConfig(max_new_tokens=16, temperature=1.0,
                                                                              seed=index, eos_token_id=None),
                             kind, DraftConfig(length=3))
                for index, kind in enumerate(["draft_model", "tree", "ngram", "draft_model"])]
    results = BatchedSpeculativeEngine(target, draft, decode=_decode, max_rows=3, compile=STATIC).run(requests)
    for request in requests:
        decoder = SpeculativeDecoder(target, build_drafter(request.drafter, target=target, draft=draft,
                                                           config=request.draft_config), decode=_decode)
        assert results[request.request_id].token_ids == decoder.generate(request.prompt_ids, request.config).token_ids


def test_chat_turns_adopt_cached_prefixes_on_static_pools():
    """The second turn adopts the first turn's blocks (prompt and reply) and gives what it gives without the cache."""
    target, draft = target_model("llama"), noisy_copy("llama")
    store = PrefixCache(64 * 2**20, block=8)
    engine = BatchedSpeculativeEngine(target, draft, decode=_decode, max_rows=2, compile=STATIC, prefix_cache=store)
    first = list(range(2, 40))
    config = GenerationConfig(max_new_tokens=12, eos_token_id=None)
    reply = engine.run([BatchRequest("turn1", first, config, "draft_model")])["turn1"]
    second = first + reply.token_ids + [5, 6, 7]
    result = engine.run([BatchRequest("turn2", second, config, "draft_model")])["turn2"]
    assert result.stats.cached_tokens >= 40
    assert result.token_ids == generate_plain(target, second, config, decode=_decode).token_ids


def test_rows_leave_for_a_group_under_its_share_on_static_pools():
    """Preemption moves a row out of a full static batch and back in: outputs unchanged."""
    target = target_model("qwen2")
    engine = BatchedSpeculativeEngine(target, noisy_copy("qwen2"), decode=_decode, max_rows=2, compile=STATIC)
    config = GenerationConfig(max_new_tokens=14, eos_token_id=None)
    requests = [BatchRequest("a1", [4, 5, 6], config, "draft_model", fair_group="a"),
                BatchRequest("a2", [7, 8], config, "tree", fair_group="a"),
                BatchRequest("b1", [9, 10, 11, 12], config, "draft_model", fair_group="b")]
    results = engine.run(requests, {"a1": 0, "a2": 0, "b1": 2})
    assert engine.preemptions >= 1
    for request in requests:
        assert results[request.request_id].token_ids == generate_plain(target, request.prompt_ids, config,
                                                                       decode=_decode).token_ids


def test_a_family_the_static_forward_does_not_run_stays_on_growing_caches():
    gpt2 = target_model("gpt2")
    assert "gpt2" in static_forward_refusal(gpt2)
    engine = BatchedSpeculativeEngine(gpt2, noisy_copy("gpt2"), decode=_decode, compile=STATIC)
    assert isinstance(engine.target_cache, RaggedCache)
    assert "gpt2" in engine.runners.refusals["target"]
    request = BatchRequest(0, [3, 4, 5], GenerationConfig(max_new_tokens=6, eos_token_id=None), "draft_model")
    assert engine.run([request])[0].token_ids == generate_plain(gpt2, [3, 4, 5], request.config,
                                                                decode=_decode).token_ids


def test_the_pool_is_sized_from_the_memory_budget():
    model = target_model("llama")
    shape = PoolShape.of(model)
    per_row = shape.bytes_per_slot() * 192
    assert pool_rows_within(shape, 192, 3 * per_row + 1, wanted_rows=16) == 3
    with pytest.raises(ConfigError, match="SPECOPS_KV_CACHE_MB"):
        pool_rows_within(shape, 192, per_row - 1, wanted_rows=16)
    # an engine whose budget holds fewer rows than it was asked for runs fewer rows
    budget_mb = 1
    engine = BatchedSpeculativeEngine(model, None, decode=_decode, max_rows=64,
                                      compile=CompileSettings(mode="auto", kv_budget_mb=budget_mb))
    capacity = engine.runners.target.capacity
    assert engine.max_rows == min(64, budget_mb * 2**20 // (shape.bytes_per_slot() * capacity))


@pytest.mark.parametrize("rows", [[1, 3], [0, 2, 3], [2, 0, 1], [3]])
def test_a_pool_keeps_rows_in_their_new_order_over_the_slots_in_use(rows):
    """Rows leaving the batch (kept rows in order) move row by row; any other order in one gather.
    Either way only the slots in use move, and a kept row's slots are exactly its old ones."""
    shape = PoolShape(layers=2, kv_heads=2, head_dim=3, dtype=torch.float64)
    pool = KVPool(shape, rows=4, capacity=10, device="cpu")
    pool.keys.copy_(torch.randn(pool.keys.shape, dtype=torch.float64))
    pool.values.copy_(torch.randn(pool.values.shape, dtype=torch.float64))
    keys, values = pool.keys.clone(), pool.values.clone()
    pool.keep_rows(rows, width=6)
    for destination, source in enumerate(rows):
        torch.testing.assert_close(pool.keys[destination, :, :, :6], keys[source, :, :, :6], rtol=0, atol=0)
        torch.testing.assert_close(pool.values[destination, :, :, :6], values[source, :, :, :6], rtol=0, atol=0)
