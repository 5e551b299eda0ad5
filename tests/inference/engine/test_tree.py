"""DraftTree structure, and the DESIGN fact the verifier rests on: one forward with a tree mask
and depth positions gives every node the logits it would get as a separate chain."""

from __future__ import annotations

import pytest
import torch

from inference.engine.decode.draft_tree import (
    DraftTree,
    tree_attention_mask,
    tree_position_ids,
)
from inference.engine.kv.rollback import new_cache
from inference.engine.lm.modeling import forward_logits

from .conftest import ARCHS, target_model

#        0 (tok 5)          1 (tok 6)
#       /        \              |
#  2 (tok 7)   3 (tok 8)    4 (tok 9)
#      |
#  5 (tok 10)
TREE = DraftTree([5, 6, 7, 8, 9, 10], [-1, -1, 0, 0, 1, 2], [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6])


def test_structure_is_derived_from_parents():
    assert TREE.depths == [1, 1, 2, 2, 2, 3]
    assert TREE.children[0] == [0, 1]
    assert TREE.children[1] == [2, 3]
    assert TREE.leaves() == [3, 4, 5]
    assert TREE.path_to(5) == [0, 2, 5]
    assert not TREE.is_chain
    assert DraftTree.chain([1, 2, 3]).is_chain
    assert TREE.max_depth == 3


def test_ancestor_matrix_marks_ancestors_and_self():
    ancestors = TREE.ancestor_matrix()
    assert ancestors[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert ancestors[4].nonzero().flatten().tolist() == [1, 4]
    assert ancestors[0].nonzero().flatten().tolist() == [0]


def test_parents_must_come_first():
    with pytest.raises(ValueError, match="parents must come first"):
        DraftTree([1, 2], [1, -1], [0.0, 0.0])


def test_mask_lets_context_rows_be_causal_and_nodes_see_prefix_and_ancestors():
    mask = tree_attention_mask(TREE.ancestor_matrix(), num_cached=3, num_context_new=2,
                               dtype=torch.float32, device=torch.device("cpu"))
    allowed = (mask[0, 0] == 0)
    assert mask.shape == (1, 1, 8, 11)
    assert allowed[0].tolist() == [True] * 4 + [False] * 7  # first new context token
    assert allowed[1].tolist() == [True] * 5 + [False] * 6
    # node 5 (row 2 + 5): the 5 prefix tokens, nodes 0, 2 and itself
    assert allowed[7].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 7, 10]
    positions = tree_position_ids(TREE.depths, 3, 2, torch.device("cpu"))
    assert positions.tolist() == [[3, 4, 5, 5, 6, 6, 6, 7]]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_context_new", [1, 4])
def test_tree_forward_equals_separate_chains(arch, num_context_new):
    model = target_model(arch, torch.float32)
    context = [11, 12, 13, 14, 15, 16, 17]
    num_cached = len(context) - num_context_new
    with torch.inference_mode():
        cache = new_cache(model)
        if num_cached:
            forward_logits(model, context[:num_cached], cache, keep=1)
        mask = tree_attention_mask(TREE.ancestor_matrix(), num_cached, num_context_new,
                                   model.dtype, model.device)
        positions = tree_position_ids(TREE.depths, num_cached, num_context_new, model.device)
        # [1 + nodes, vocab]: after the last context token, then after each node
        tree_logits = forward_logits(model, context[num_cached:] + TREE.token_ids, cache,
                                     keep=len(TREE) + 1, attention_mask=mask,
                                     position_ids=positions)
        for node in range(len(TREE)):
            path = [TREE.token_ids[n] for n in TREE.path_to(node)]
            chain = model(torch.tensor([context + path])).logits[0]
            torch.testing.assert_close(tree_logits[1 + node], chain[-1], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(tree_logits[0], chain[len(context) - 1], atol=2e-5,
                                       rtol=1e-4)
