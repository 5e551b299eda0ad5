"""The `dspark` drafter: one backbone forward drafts a whole block from the target's own features.

At each step the decoder has run the target over the committed positions and handed this
drafter their features (`observe_target_features`: the hidden states of the checkpoint's
`target_layer_ids`, captured from the prefill and verify forwards the decoder ran anyway). The
anchor — the last token, which the target produced but has not read yet — and γ−1 mask tokens go
through the backbone in one forward, attending to every context position's projected features;
the Markov head then draws the block left to right (greedy: argmax; sampled: from the same warped
q the verifier divides by). Per position the confidence head's c_k (calibrated by a temperature
per position when the checkpoint has one) gives the survival estimate ∏_{i≤k} c_i that the
engine's scheduler reads: it depends on the tokens before k, never on k's own.

The drafter never sees a rejected position's features: the decoder hands over the committed
positions only, so there is nothing to roll back.
"""

from __future__ import annotations

import math

import torch

from inference.engine.config import DraftConfig
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.sampling import warp_probs
from inference.engine.drafters.base import Drafter, DraftRequest
from inference.engine.drafters.dspark.modeling import ContextCache, DSparkModel
from inference.engine.lm.modeling import align_vocab


def survival_estimates(confidence_logits: torch.Tensor | None, temperatures: list[float] | None,
                       depth: int) -> list[float] | None:
    """∏_{i≤k} σ(logit_i / T_i) for k < depth; None without a confidence head."""
    if confidence_logits is None:
        return None
    survival, running = [], 1.0
    for position in range(depth):
        temperature = temperatures[position] if temperatures else 1.0
        running *= 1.0 / (1.0 + math.exp(-float(confidence_logits[position]) / temperature))
        survival.append(running)
    return survival


class DSparkDrafter(Drafter):
    """Drafts up to the checkpoint's block size; built as `DSparkDrafter(model, vocab_width, config)`."""

    def __init__(self, draft: DSparkModel, vocab_width: int, config: DraftConfig) -> None:
        super().__init__(config)
        self.model = draft
        self.vocab_width = vocab_width
        self.context = ContextCache()

    @property
    def nominal_depth(self) -> int:
        return self.model.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose hidden states this drafter reads (features.py)."""
        return self.model.dspark.target_layer_ids

    def begin(self, prompt_ids: list[int]) -> None:
        self.context = ContextCache()

    def context_prefix(self, length: int, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Its backbone's keys and values of context positions start..length, per layer
        [heads, tokens, dim]: what the prefix cache keeps (kv/prefix_cache.py)."""
        return [(keys[0, :, start:length], values[0, :, start:length])
                for keys, values in zip(self.context.keys, self.context.values)]

    def adopt_context(self, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Start from a cached prefix's `length` positions (as `context_prefix` gives them)
        instead of observing their features again."""
        self.context = ContextCache([keys[None] for keys, _ in layers], [values[None] for _, values in layers],
                                    length)

    @torch.inference_mode()
    def observe_target_features(self, features: torch.Tensor) -> None:
        """The features of the next committed positions, [1, tokens, feature_width], in order."""
        self.model.extend_context(self.context, features)

    @torch.inference_mode()
    def propose(self, context: list[int], request: DraftRequest) -> DraftTree:
        depth = min(request.max_depth, self.model.block_size)
        start = len(context) - 1
        if depth <= 0 or self.context.length == 0:
            return DraftTree.empty()
        if self.context.length != start:
            raise RuntimeError(f"dspark: features for {self.context.length} positions, the context "
                               f"has {start} before its anchor (the decoder must hand over every "
                               "committed position's features)")
        device = self.model.fc.weight.device
        anchor = torch.tensor([context[-1]], device=device)
        hidden = self.model.block_hidden(self.model.block_ids(anchor), torch.tensor([start], device=device),
                                         self.context.keys, self.context.values)[0]
        return draft_block(self.model, hidden, context[-1], depth, self.vocab_width, request,
                           self.config.confidence_threshold)


def draft_block(model: DSparkModel, hidden: torch.Tensor, anchor: int, depth: int, vocab_width: int,
                request: DraftRequest, threshold: float = 0.0) -> DraftTree:
    """Draw `depth` tokens left to right from one block's hidden states [γ, hidden]."""
    base = model.lm_head(hidden[:depth])
    tokens: list[int] = []
    log_probs: list[float] = []
    rows: list[torch.Tensor] = []
    previous = torch.tensor([anchor], device=hidden.device)
    previous_ids = []
    for position in range(depth):
        previous_ids.append(int(previous[0]))
        logits = align_vocab(model.markov_logits(base[position:position + 1], previous,
                                                 hidden[position:position + 1]), vocab_width)
        if request.sampling is None:
            log_q = logits[0].float().log_softmax(dim=-1)
            best, token_tensor = log_q.max(dim=-1)
            token = int(token_tensor)
            log_probs.append(float(best))
        else:
            q = warp_probs(logits.float(), request.sampling)[0]
            token = int(torch.multinomial(q, 1, generator=request.generator))
            log_probs.append(float(q[token].clamp_min(1e-30).log()))
            rows.append(q)
        tokens.append(token)
        previous = torch.tensor([token], device=hidden.device)
    confidence = model.confidence_logits(hidden[:depth], torch.tensor(previous_ids, device=hidden.device))
    survival = survival_estimates(confidence, model.calibration, depth)
    return block_tree(tokens, log_probs, rows, survival, threshold)


def block_tree(tokens: list[int], log_probs: list[float], rows: list[torch.Tensor],
               survival: list[float] | None, threshold: float) -> DraftTree:
    """A drafted block as a chain, cut at the confidence threshold (0: never)."""
    if threshold and survival is not None:
        # DeepSpec's confident prefix: cut at the first position whose own c_k is under the
        # threshold (c_k reads x_{k-1}, not x_k, so the cut never looks at the token it drops)
        conditional = [survival[0]] + [b / a if a > 0 else 0.0 for a, b in zip(survival, survival[1:])]
        keep = next((k for k, c in enumerate(conditional) if c < threshold), len(tokens))
        tokens, log_probs, rows, survival = tokens[:keep], log_probs[:keep], rows[:keep], survival[:keep]
    tree = DraftTree.chain(tokens, log_probs, torch.stack(rows) if rows else None)
    tree.survival = survival
    return tree
