"""DSpark's training forward: many anchor blocks of a sequence in one backbone call, and its loss.

Written from the paper and DeepSpec's public training code (``deepspec/modeling/dspark/``:
``common.py`` samples anchors and builds the mask, ``loss.py`` the loss); this is the project's own.

For a token sequence x (text the target wrote) and the target's features at every position,
captured during ONE frozen target forward over x (`target_pass`), each anchor a (a + 1 < len)
makes a block [x_a, MASK × (γ−1)] at positions a..a+γ−1. A block's queries see the projected
features of the context positions < a — exactly what the drafter holds when x_a is the last
token the target produced (drafter.py) — and every position of their own block; nothing else,
so many blocks share one forward without seeing each other. Position k of block b predicts
x_{a+1+k}; its Markov head is teacher-forced with x_{a+k} (the anchor for k = 0), the token a
drafted block has there once the positions before k survived.

The loss (`dspark_loss`) is 0.1·CE + 0.9·TV + 1.0·BCE(confidence), each position k (0-based)
weighted exp(−k/γ): TV = ½‖p_draft − p_target‖₁ against the target's next-token distribution at
a + k (its logits from the same forward), and the confidence head is trained towards 1 − TV, the
exact probability that a sampled draft token survives verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from inference.engine.drafters.dspark.modeling import ContextCache, DSparkModel
from inference.engine.lm.features import tapped

#: The paper's loss weights: cross-entropy, total variation, confidence BCE.
LOSS_WEIGHTS = (0.1, 0.9, 1.0)


@dataclass
class TargetPass:
    """What one frozen target forward over x gives the drafter's training."""

    features: torch.Tensor  # [batch, length, feature_width]: the tapped layers, concatenated
    logits: torch.Tensor  # [batch, length, vocab] float32: the target's next-token logits


@torch.no_grad()
def target_pass(target: PreTrainedModel, tokens: torch.Tensor, layer_ids: tuple[int, ...]) -> TargetPass:
    """Run the frozen target once over `tokens` [batch, length]; keep its features and logits."""
    with tapped(target, layer_ids) as tap:
        logits = target(tokens.to(target.device), use_cache=False).logits
    return TargetPass(tap.features().detach(), logits.float())


def sample_anchors(batch: int, length: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, n] sorted anchor positions, distinct within a row, each with a + 1 < length.

    n = min(count, length − 1): every anchor has at least its first label inside the sequence.
    """
    candidates = length - 1
    if candidates < 1:
        raise ValueError(f"sequences of {length} tokens have no anchor (a + 1 < length needs 2 tokens)")
    n = min(count, candidates)
    scores = torch.rand(batch, candidates, generator=generator)
    return scores.argsort(dim=1)[:, :n].sort(dim=1).values


def block_mask(anchors: torch.Tensor, length: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[batch, 1, n·γ, length + n·γ] additive: context keys < own anchor, and the own block."""
    batch, n = anchors.shape
    queries = n * block_size
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [batch, n·γ]
    context = torch.arange(length, device=anchors.device)[None, None, :] < query_anchor[:, :, None]
    block_of = torch.arange(queries, device=anchors.device) // block_size
    own_block = (block_of[:, None] == block_of[None, :]).expand(batch, queries, queries)
    allowed = torch.cat((context, own_block), dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=anchors.device)
    return mask.masked_fill_(~allowed, float("-inf"))[:, None]


@dataclass
class BlockOutput:
    """The training forward's outputs, per sequence, anchor block and block position k."""

    logits: torch.Tensor  # [batch, n, γ, vocab]: base logits plus the teacher-forced Markov bias
    confidence: torch.Tensor | None  # [batch, n, γ]: the confidence head's logits
    labels: torch.Tensor  # [batch, n, γ]: x_{a+1+k}
    valid: torch.Tensor  # [batch, n, γ] bool: the label lies inside the sequence
    target_logits: torch.Tensor | None  # [batch, n, γ, vocab]: the target's at a + k


def block_forward(model: DSparkModel, tokens: torch.Tensor, anchors: torch.Tensor,
                  features: torch.Tensor, target_logits: torch.Tensor | None = None) -> BlockOutput:
    """Every anchor block of every sequence in one backbone forward (module docstring).

    tokens [batch, length]; anchors [batch, n]; features [batch, length, feature_width];
    target_logits [batch, length, vocab] or None.
    """
    device = model.fc.weight.device
    tokens, anchors = tokens.to(device).long(), anchors.to(device).long()
    batch, length = tokens.shape
    gamma = model.block_size
    offsets = torch.arange(gamma, device=device)
    positions = anchors[:, :, None] + offsets  # [batch, n, γ]
    block_ids = torch.full_like(positions, model.dspark.mask_token_id)
    anchor_tokens = tokens.gather(1, anchors)  # [batch, n]
    block_ids[:, :, 0] = anchor_tokens
    context = ContextCache()
    model.extend_context(context, features.to(device))
    mask = block_mask(anchors, length, gamma, model.fc.weight.dtype)
    n = anchors.shape[1]
    hidden = model.hidden_at(block_ids.view(batch, n * gamma), positions.view(batch, n * gamma),
                             context.keys, context.values, mask).view(batch, n, gamma, -1)
    label_index = positions + 1
    valid = label_index < length
    labels = tokens.gather(1, label_index.clamp(max=length - 1).view(batch, -1)).view(batch, n, gamma)
    previous = torch.cat((anchor_tokens[:, :, None], labels[:, :, :-1]), dim=2)  # x_{a+k}
    logits = model.markov_logits(model.lm_head(hidden), previous, hidden)
    confidence = model.confidence_logits(hidden, previous)
    aligned = None
    if target_logits is not None:
        width = logits.shape[-1]
        index = positions.clamp(max=length - 1).view(batch, -1)  # the target's logits at a + k
        gathered = target_logits.to(device)[torch.arange(batch, device=device)[:, None], index]
        aligned = gathered.view(batch, n, gamma, -1)[..., :width].float()
    return BlockOutput(logits, confidence, labels, valid, aligned)


def position_weights(valid: torch.Tensor) -> torch.Tensor:
    """exp(−k/γ) for 0-based k (the paper's exp(−(k−1)/γ), 1-based), zero where there is no label."""
    gamma = valid.shape[-1]
    decay = torch.exp(-torch.arange(gamma, device=valid.device, dtype=torch.float32) / gamma)
    return valid.float() * decay


def acceptance_rates(output: BlockOutput) -> torch.Tensor:
    """[batch, n, γ] 1 − TV(p_draft, p_target): the chance a sampled draft token survives."""
    draft = output.logits.float().softmax(dim=-1)
    target = output.target_logits.softmax(dim=-1)
    return (1.0 - 0.5 * (draft - target).abs().sum(dim=-1)).clamp(0.0, 1.0)


def dspark_loss(output: BlockOutput, weights: tuple[float, float, float] = LOSS_WEIGHTS
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """0.1·CE + 0.9·TV + 1.0·confidence BCE, position-weighted; returns (loss, its parts)."""
    if output.target_logits is None:
        raise ValueError("the DSpark loss needs the target's logits (TV and the confidence target)")
    w = position_weights(output.valid)
    total = w.sum().clamp_min(1e-6)
    log_q = output.logits.float().log_softmax(dim=-1)
    ce = -log_q.gather(-1, output.labels[..., None]).squeeze(-1)
    tv = 0.5 * (log_q.exp() - output.target_logits.softmax(dim=-1)).abs().sum(dim=-1)
    ce_mean, tv_mean = (ce * w).sum() / total, (tv * w).sum() / total
    loss = weights[0] * ce_mean + weights[1] * tv_mean
    parts = {"ce": float(ce_mean.detach()), "tv": float(tv_mean.detach())}
    if output.confidence is not None:
        accept = (1.0 - tv).clamp(0.0, 1.0).detach()
        bce = F.binary_cross_entropy_with_logits(output.confidence, accept, reduction="none")
        bce_mean = (bce * w).sum() / total
        loss = loss + weights[2] * bce_mean
        parts["confidence"] = float(bce_mean.detach())
    parts["loss"] = float(loss.detach())
    return loss, parts
