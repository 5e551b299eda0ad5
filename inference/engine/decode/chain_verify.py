"""The rejection rule for a chain of drafts, as tensor operations that never read a value back.

A chain (every node continues the one before: the draft model's, n-gram and suffix drafts) is
verified by one rule at every position, so its verdict is a handful of tensor operations: which
positions pass, how many pass in a row, and the token the target adds. Nothing here reads a
value on the host, so a batched step can verify every row and read all of them back at once
(batch/device_verify.py); the single-sequence decoder reads its one verdict at once.

Terms, as in verify.py: a chain of k drafted tokens x_1..x_k, the target's distributions
p_0..p_k (p_i after the context and x_1..x_i), and the draft's q_1..q_k (None for a drafter
that proposes tokens without a distribution: a point mass). Position i is **accepted** when
u_i < min(1, p_{i-1}(x_i) / q_i(x_i)) (point mass: u_i < p_{i-1}(x_i)); the verdict keeps the
longest run of accepted positions, a; the **next token** is drawn from norm(max(p_a - q_{a+1},
0)) after a rejection (point mass: p_a without x_{a+1}), or from p_k when all k passed (the
bonus token). The k uniforms are drawn first, then the next token, from the row's generator:
the draws depend on nothing but the generator, so a row's tokens are the same whichever path
verifies it.
"""

from __future__ import annotations

import torch


def greedy_chain_verdict(
    # [k] the drafted tokens
    draft: torch.Tensor,
    # [k + 1] the target's argmax after the context and after each drafted token
    target_tokens: torch.Tensor,
) -> torch.Tensor:
    """[2]: (accepted count, next token) of a greedy chain: the drafts that equal the target's argmax."""
    k = draft.shape[0]
    matched = (draft == target_tokens[:k]).to(torch.long)
    accepted = matched.cumprod(dim=0).sum()
    return torch.stack((accepted, target_tokens[accepted]))


def sampled_chain_verdict(
    # [k] the drafted tokens
    draft: torch.Tensor,
    # [k + 1, vocab_size] the target's distributions (after warping)
    target_probs: torch.Tensor,
    # [k, vocab_size] the distributions the drafts were drawn from, or None (point masses)
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """[2]: (accepted count, next token) by the rejection rule (see the module docstring)."""
    k = draft.shape[0]
    device = target_probs.device
    if k == 0:
        return torch.stack((torch.zeros((), dtype=torch.long, device=device),
                            torch.multinomial(target_probs[0], 1, generator=generator)[0]))
    uniforms = torch.rand(k, generator=generator, device=device)
    positions = torch.arange(k, device=device)
    p = target_probs[:k]
    p_of_draft = p[positions, draft]
    if draft_probs is None:
        passed = uniforms < p_of_draft
        residual = p.clone()
        residual[positions, draft] = 0.0
    else:
        q = draft_probs.to(p.dtype)
        passed = uniforms < (p_of_draft / q[positions, draft]).clamp(max=1.0)
        residual = (p - q).clamp_min(0.0)
    total = residual.sum(dim=-1, keepdim=True)
    # p itself where the residual is empty up to rounding (verify._residual does the same)
    residual = torch.where(total > torch.finfo(p.dtype).eps, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p)
    accepted = passed.to(torch.long).cumprod(dim=0).sum()
    # [k + 1, vocab]: the distribution after a rejection at each position, or p_k after none
    final = torch.cat((residual, target_probs[k:k + 1])).index_select(0, accepted.reshape(1))[0]
    return torch.stack((accepted, torch.multinomial(final, 1, generator=generator)[0]))
