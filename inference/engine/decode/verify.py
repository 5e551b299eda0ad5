"""Rejection sampler: decide which drafted path the target accepts. Knows no drafter.

Input is a `DraftTree` and the target's output at the last context token (row 0) and at every
node (row 1 + i). Output is the accepted path and one more token from the target (the
correction after a rejection, or the bonus token when a leaf was reached), so every step
yields at least one token and the output is exactly what the target alone would produce:
- greedy: follow the child whose token is the target's argmax;
- sampling: recursive rejection sampling over siblings (SpecInfer; Jeon et al. 2024 for
  siblings drawn without replacement). For sibling x drawn from q: accept with
  min(1, p(x) / q(x)); on rejection p <- norm(max(p - q, 0)) and q <- q without x,
  renormalised; when every sibling is rejected, sample from the current p. A deterministic
  proposal is a point mass q = delta_x: accept with p(x), else remove x from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.engine.decode.chain_verify import sampled_chain_verdict
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.sampling import sample_token, uniform


@dataclass(frozen=True)
class VerifyResult:
    """The accepted nodes (root first) and the target's own next token."""

    accepted_nodes: list[int]
    next_token: int


def verify_greedy(tree: DraftTree, target_tokens: list[int]) -> VerifyResult:
    """Accept the path that matches the target's argmax at every step.

    target_tokens[0] is the argmax after the last context token, target_tokens[1 + i] the
    argmax after node i. Siblings carry distinct tokens, so at most one child matches.
    """
    accepted: list[int] = []
    row = 0
    while True:
        wanted = target_tokens[row]
        match = next((child for child in tree.children[row] if tree.token_ids[child] == wanted), None)
        if match is None:
            return VerifyResult(accepted, wanted)
        accepted.append(match)
        row = match + 1


def _residual(
    # [vocab_size]
    p: torch.Tensor,
    # [vocab_size]
    q: torch.Tensor,
) -> torch.Tensor:
    """norm(max(p - q, 0)); falls back to p when p <= q everywhere up to rounding."""
    residual = (p - q).clamp_min_(0)
    total = residual.sum()
    if total <= torch.finfo(p.dtype).eps:
        return p
    return residual / total


def _choose_child(
    tree: DraftTree,
    children: list[int],
    # [vocab_size]
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int | None, torch.Tensor]:
    """Run recursive rejection over one sibling group; return (accepted child or None, p)."""
    q = None
    for child in children:
        token = tree.token_ids[child]
        if tree.draft_probs is None:
            accept_probability = float(p[token])
            if uniform(generator, p.device) < accept_probability:
                return child, p
            point_mass = torch.zeros_like(p)
            point_mass[token] = 1.0
            p = _residual(p, point_mass)
            continue
        if q is None:
            q = tree.draft_probs[child].to(p.dtype)
        ratio = float(p[token] / q[token])
        if uniform(generator, p.device) < min(1.0, ratio):
            return child, p
        p = _residual(p, q)
        q = q.clone()
        q[token] = 0.0
        q_total = q.sum()
        if q_total <= 0:
            break
        q = q / q_total
    return None, p


def verify_sampling(
    tree: DraftTree,
    # [1 + num_nodes, vocab_size] target distributions after warping (temperature, top-k, top-p)
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Accept a path so that the emitted tokens follow the target's distribution exactly.

    A chain goes through chain_verify.py (its draws in one fixed order, whichever path verifies
    it: a batched step's device verdicts give the same tokens); a tree with siblings here.
    """
    if tree.is_chain:
        draft = torch.tensor(tree.token_ids, dtype=torch.long, device=target_probs.device)
        accepted_count, next_token = sampled_chain_verdict(draft, target_probs, tree.draft_probs, generator).tolist()
        return VerifyResult(list(range(accepted_count)), next_token)
    accepted: list[int] = []
    row = 0
    while True:
        p = target_probs[row]
        children = tree.children[row]
        child, p = _choose_child(tree, children, p, generator) if children else (None, p)
        if child is None:
            return VerifyResult(accepted, sample_token(p, generator))
        accepted.append(child)
        row = child + 1
