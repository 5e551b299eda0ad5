"""Temperature, top-k and top-p, applied the same way to the target (p) and the draft (q).

Lossless speculative sampling needs p and q to be the distributions the tokens are actually
drawn from, so both go through `warp_probs` with the same `SamplingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """The sampling part of a GenerationConfig; temperature > 0."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0


def warp_probs(
    # [num_rows, vocab_size]
    logits: torch.Tensor,
    params: SamplingParams,
) -> torch.Tensor:
    """Return the distributions to sample from, [num_rows, vocab_size], in the logits' dtype.

    Order as in Hugging Face: temperature, then top-k, then top-p (smallest set whose mass
    reaches top_p, always at least the most likely token).

    Finite for any temperature > 0 and top_p > 0: the row's maximum is subtracted before the
    division (so scores are <= 0 and a tiny temperature sends every other token to -inf, not the
    maximum to +inf), the work is in float32 at least (float64 when the temperature is below
    the working type's range), and the most likely token is never dropped, so every row keeps mass 1.
    """
    work = torch.promote_types(logits.dtype, torch.float32)  # half and bfloat16 logits are worked in float32
    if params.temperature < torch.finfo(work).tiny:
        work = torch.float64
    scores = logits.to(work)
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / params.temperature
    vocab_size = scores.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth_best = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False  # the most likely token stays, however small top_p is
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1).to(logits.dtype)


def sample_token(
    # [vocab_size]
    probs: torch.Tensor,
    generator: torch.Generator | None,
) -> int:
    """Draw one token id from `probs`."""
    return int(torch.multinomial(probs, 1, generator=generator))


def uniform(generator: torch.Generator | None, device: torch.device) -> float:
    """One U(0, 1) draw from the run's generator (the acceptance test of rejection sampling)."""
    return float(torch.rand((), generator=generator, device=device))
