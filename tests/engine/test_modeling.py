"""The lean Llama/Qwen2 forward gives the wrapped forward's logits; the target-only loop equals HF greedy."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from inference.engine import GenerationConfig
from inference.engine.draft_tree import (
    DraftTree,
    tree_attention_mask,
    tree_position_ids,
)
from inference.engine.kv_cache import new_cache
from inference.engine.modeling import _lean_logits, supports_lean_forward
from inference.engine.target_only import generate_plain

from .conftest import ARCHS, target_model

CONTEXT = [4, 8, 15, 16, 23, 42, 7]
TREE = DraftTree([5, 6, 7, 8], [-1, -1, 0, 1], [0.0] * 4)


def _wrapped(model, tokens, cache, keep, mask=None, positions=None):
    output = model(input_ids=torch.tensor([tokens]), cache=cache, attention_mask=mask,
                   position_ids=positions, use_cache=True, logits_to_keep=keep)
    return output.logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
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
