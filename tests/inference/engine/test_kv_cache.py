"""Rollback keeps exactly the accepted path: the cache afterwards equals one built from scratch."""

from __future__ import annotations

import pytest
import torch

from inference.engine.decode.draft_tree import (
    DraftTree,
    tree_attention_mask,
    tree_position_ids,
)
from inference.engine.kv.rollback import keep_accepted, new_cache, truncate_cache
from inference.engine.lm.modeling import forward_logits

from .conftest import ARCHS, target_model

TREE = DraftTree([5, 6, 7, 8, 9], [-1, -1, 0, 1, 3], [0.0] * 5)
CONTEXT = [20, 21, 22, 23, 24]


def _cache_of(model, tokens):
    cache = new_cache(model)
    forward_logits(model, tokens, cache, keep=1)
    return cache


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("accepted", [[1, 3, 4], [0, 2], [], [1]])
def test_keep_accepted_equals_encoding_the_accepted_path(arch, accepted):
    model = target_model(arch)
    with torch.inference_mode():
        cache = _cache_of(model, CONTEXT[:-1])
        mask = tree_attention_mask(TREE.ancestor_matrix(), len(CONTEXT) - 1, 1, model.dtype,
                                   model.device)
        positions = tree_position_ids(TREE.depths, len(CONTEXT) - 1, 1, model.device)
        forward_logits(model, CONTEXT[-1:] + TREE.token_ids, cache, keep=1,
                       attention_mask=mask, position_ids=positions)
        keep_accepted(cache, len(CONTEXT), accepted)
        path = CONTEXT + [TREE.token_ids[node] for node in accepted]
        reference = _cache_of(model, path)
        assert cache.get_seq_length() == len(path)
        for kept, fresh in zip(cache.layers, reference.layers):
            torch.testing.assert_close(kept.keys, fresh.keys)
            torch.testing.assert_close(kept.values, fresh.values)
        # and decoding continues as if the rejected nodes had never been there
        next_logits = forward_logits(model, [3], cache, keep=1)
        expected = forward_logits(model, [3], reference, keep=1)
        torch.testing.assert_close(next_logits, expected)


def test_truncate_cache_drops_the_tail_only():
    model = target_model("llama")
    with torch.inference_mode():
        cache = _cache_of(model, CONTEXT)
        truncate_cache(cache, 3)
        assert cache.get_seq_length() == 3
        truncate_cache(cache, 10)
        assert cache.get_seq_length() == 3
