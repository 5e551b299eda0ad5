"""The target's logits masked to what the grammar allows, and drafts the grammar forbids pruned.

Masking happens on the logits, before temperature, top-k and top-p, as a logits processor in
Hugging Face `generate` would: the constrained target is then softmax(masked logits) warped,
and the verifier (unchanged) makes every emitted token follow exactly that distribution.
"""

from __future__ import annotations

import torch

from inference.engine.decode.draft_tree import DraftTree


def mask_logits(
    # [rows, vocab_size]
    logits: torch.Tensor,
    # [rows, vocab_size] bool, true where the grammar allows the token
    allowed: torch.Tensor,
) -> torch.Tensor:
    """The logits with every forbidden token at -inf (a new tensor)."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def prune_forbidden(tree: DraftTree, valid: list[bool]) -> list[int]:
    """The nodes worth verifying: those whose ancestors the grammar all allows.

    A forbidden node is never accepted (the masked target gives it probability 0), so its
    descendants are dropped. The forbidden node itself is dropped too unless it carries a draft
    distribution: siblings drawn without replacement are verified in order against q without
    the earlier ones, so it must stay for the rule to hold (a point mass with p = 0 is a
    rejection that leaves p unchanged, so skipping it changes nothing).
    """
    reachable = [False] * len(tree)
    kept = []
    for node, parent in enumerate(tree.parent_ids):
        if parent >= 0 and not reachable[parent]:
            continue
        reachable[node] = valid[node]
        if valid[node] or tree.draft_probs is not None:
            kept.append(node)
    return kept


def subtree(tree: DraftTree, kept: list[int]) -> DraftTree:
    """The tree restricted to `kept` (parents first, every kept node's parent kept)."""
    if len(kept) == len(tree):
        return tree
    index = {node: position for position, node in enumerate(kept)}
    return DraftTree(
        [tree.token_ids[node] for node in kept],
        [index[tree.parent_ids[node]] if tree.parent_ids[node] >= 0 else -1 for node in kept],
        [tree.log_probs[node] for node in kept],
        tree.draft_probs[kept] if tree.draft_probs is not None and kept else None,
        [tree.survival[node] for node in kept] if tree.survival is not None else None,
    )


def with_forced_prefix(forced: list[int], tree: DraftTree) -> DraftTree:
    """A chain of the grammar's forced tokens followed by `tree` (drafted after them).

    Forced nodes are point masses in the draft (q = delta), and the masked target gives their
    token probability 1, so verification accepts them with certainty: never injected unverified,
    yet free. Their survival is 1, the drafter's estimates follow unchanged.
    """
    count = len(forced)
    if not count:
        return tree
    probs = None
    if tree.draft_probs is not None:
        # [forced + nodes, vocab_size]
        one_hot = torch.zeros(count, tree.draft_probs.shape[1], dtype=tree.draft_probs.dtype,
                              device=tree.draft_probs.device)
        one_hot[torch.arange(count), torch.tensor(forced)] = 1.0
        probs = torch.cat([one_hot, tree.draft_probs])
    parents = list(range(-1, count - 1)) + [count - 1 if parent < 0 else parent + count
                                            for parent in tree.parent_ids]
    survival = [1.0] * count + tree.survival if tree.survival is not None else None
    return DraftTree(list(forced) + tree.token_ids, parents, [0.0] * count + tree.log_probs,
                     probs, survival)
