"""The lean Llama/Qwen2 forward gives the wrapped forward's logits; the target-only loop equals HF greedy."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.cache_utils import DynamicLayer

from inference.engine import GenerationConfig
from inference.engine.decode.draft_tree import (
    DraftTree,
    tree_attention_mask,
    tree_position_ids,
)
from inference.engine.kv.rollback import new_cache
from inference.engine.lm.modeling import _lean_logits, supports_lean_forward
from inference.engine.kv.ragged import RaggedCache, RowInput
from inference.engine.decode.target_only import generate_plain

from .conftest import ARCHS, VOCAB_SIZE, target_model

CONTEXT = [4, 8, 15, 16, 23, 42, 7]
TREE = DraftTree([5, 6, 7, 8], [-1, -1, 0, 1], [0.0] * 4)


def _wrapped(model, tokens, cache, keep, mask=None, positions=None):
    output = model(input_ids=torch.tensor([tokens]), cache=cache, attention_mask=mask,
                   position_ids=positions, use_cache=True, logits_to_keep=keep)
    return output.logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_lean_forward_matches_the_wrapped_forward(arch):
    model = target_model(arch, torch.float32)
    assert supports_lean_forward(model)
    with torch.inference_mode():
        lean_cache, wrapped_cache = new_cache(model), new_cache(model)
        steps = [(CONTEXT, 1, None), ([9], 1, None), ([10, 11, 12], 3, None), ("tree", 5, TREE)]
        for tokens, keep, tree in steps:
            mask = positions = None
            if tree is not None:
                cached = lean_cache.get_seq_length()
                mask = tree_attention_mask(tree.ancestor_matrix(), cached, 1, model.dtype, model.device)
                positions = tree_position_ids(tree.depths, cached, 1, model.device)
                tokens = [3] + tree.token_ids
            ids = torch.tensor([tokens])
            lean = _lean_logits(model, ids, lean_cache, keep, mask, positions)
            wrapped = _wrapped(model, tokens, wrapped_cache, keep, mask, positions)
            torch.testing.assert_close(lean, wrapped, atol=1e-5, rtol=1e-5)
        assert lean_cache.get_seq_length() == wrapped_cache.get_seq_length()


def test_lean_forward_is_only_used_where_it_is_known_to_be_exact():
    assert not supports_lean_forward(target_model("gpt2"))
    sliding = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
        max_window_layers=0))
    assert not supports_lean_forward(sliding)
    windowed = MistralForCausalLM(MistralConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8))
    assert not supports_lean_forward(windowed)


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_loop_equals_hf_generate_greedy(arch):
    """An oracle independent of our forward: transformers' own greedy search."""
    model = target_model(arch)
    for prompt in ([3, 1, 4, 1, 5, 9], [2, 7], list(range(30, 60))):
        ours = generate_plain(model, prompt, GenerationConfig(max_new_tokens=24)).token_ids
        with torch.inference_mode():
            input_ids = torch.tensor([prompt])
            theirs = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        assert ours == theirs[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_lean_attention_equals_transformers_grouped_query_sdpa_bit_for_bit(arch, monkeypatch):
    """Ragged batches (a mask, 1 or several new tokens a row) in float32, where SDPA's fused CPU
    kernel runs: the lean layer (SDPA's `enable_gqa`, keys appended in place) gives the logits of
    transformers' own layers forced to the same grouped-query SDPA, exactly; with several new
    tokens transformers' default path (`repeat_kv`) gives them too."""
    model = target_model(arch, torch.float32)
    generator = torch.Generator().manual_seed(5)
    lean_cache = RaggedCache(model)
    for _ in range(4):
        lean_cache.add_row()
    with torch.inference_mode():
        for step, widths in enumerate([(7, 3, 0, 5), (1, 1, 1, 0), (4, 2, 4, 1), (1, 0, 1, 1)]):
            inputs = []
            for row, count in enumerate(widths):
                start = len(lean_cache.row_slots(row))
                tokens = torch.randint(2, VOCAB_SIZE, (count,), generator=generator).tolist()
                inputs.append(RowInput(tokens, list(range(start, start + count))))
            wrapped_cache = copy.deepcopy(lean_cache.cache)
            wrapped_cache.layers = [_as_dynamic_layer(layer) for layer in wrapped_cache.layers]
            expected = _wrapped_ragged_forward(model, lean_cache, wrapped_cache, inputs, monkeypatch,
                                               force_gqa=max(widths) == 1)
            lean = lean_cache.forward(inputs)
            for row, count in enumerate(widths):
                assert torch.equal(lean[row], expected[row, :count]), (step, row)
            lean_cache.truncate_row(0, len(lean_cache.row_slots(0)) - 1)  # a rejected draft: a hole


def _as_dynamic_layer(layer):
    plain = DynamicLayer()
    if layer.is_initialized:
        plain.lazy_initialization(layer.keys, layer.values)
        plain.keys, plain.values = layer.keys.clone(), layer.values.clone()
    return plain


def _wrapped_ragged_forward(model, ragged, cache, inputs, monkeypatch, force_gqa):
    """transformers' wrapped forward of the same padded inputs and mask RaggedCache.forward builds."""
    captured = {}

    def capture(model_, input_ids, cache_, attention_mask, position_ids, logits, last_index):
        captured.update(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        raise _Captured

    monkeypatch.setattr("inference.engine.kv.ragged.forward_batch_logits", capture)
    probe = copy.deepcopy(ragged)
    with pytest.raises(_Captured):
        probe.forward(inputs)
    monkeypatch.undo()
    if force_gqa:
        monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    output = model(input_ids=captured["input_ids"], cache=cache, attention_mask=captured["attention_mask"],
                   position_ids=captured["position_ids"], use_cache=True)
    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
    return output.logits


class _Captured(Exception):
    pass
