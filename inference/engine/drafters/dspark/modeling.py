"""The DSpark drafter's network: backbone on injected target features, Markov head, confidence head.

Written for this engine from the paper and DeepSpec's public modeling
(``deepspec/modeling/dspark/qwen3/modeling.py``); the parameter names are DeepSpec's, so its
checkpoints load as they are (checkpoint.py):

- ``fc`` and ``hidden_norm`` project the concatenated target features of a context position to
  one hidden vector: RMSNorm(W·[H(l1); …; H(lm)]).
- every backbone layer (``layers.i``: Qwen3 attention with q/k norms, a SwiGLU MLP) attends from
  the block's positions to the projected context (its own k/v projections of it, rotated at the
  context positions) and to the whole block, bidirectionally; the block is the anchor (the last
  token the target produced) followed by γ−1 ``mask_token_id`` embeddings.
- ``lm_head`` (a copy of the target's, frozen) gives the base logits of γ positions at once.
- ``markov_head``: a rank-r transition bias W2·W1[x_{k−1}] added to position k's logits, so the
  block is drawn left to right cheaply and stays coherent (``gated`` scales W1[x] by a gate on
  [h_k; W1[x]]).
- ``confidence_head``: c_k = σ(w·[h_k; W1[x_{k−1}]]), the probability that position k survives
  verification given that the positions before it did. It reads x_{k−1}, never x_k: a decision
  made on it about position k does not look at k's own token (what keeps scheduling lossless).

The context keys and values are computed once per context position and kept per layer
(`ContextCache`), so a position's target features are projected exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from inference.engine.drafters.dspark.config import DSparkConfig


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [batch, heads, tokens, head_dim]; cos/sin: [batch, tokens, head_dim]
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DSparkAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.scaling = self.head_dim ** -0.5

    def keys_values(self, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values of `states` [batch, tokens, hidden]; each [batch, kv_heads, tokens, head_dim]."""
        batch, tokens = states.shape[:2]
        key = self.k_norm(self.k_proj(states).view(batch, tokens, self.kv_heads, self.head_dim)).transpose(1, 2)
        value = self.v_proj(states).view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(key, cos, sin), value

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context_key: torch.Tensor, context_value: torch.Tensor,
                # [batch, 1, block, context + block] additive, or None (every key visible)
                mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, tokens = hidden.shape[:2]
        query = self.q_norm(self.q_proj(hidden).view(batch, tokens, self.heads, self.head_dim)).transpose(1, 2)
        query = _rotate(query, cos, sin)
        block_key, block_value = self.keys_values(hidden, cos, sin)
        key = torch.cat((context_key, block_key), dim=2)
        value = torch.cat((context_value, block_value), dim=2)
        output = nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=self.scaling, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(output.transpose(1, 2).reshape(batch, tokens, -1))


class DSparkLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = DSparkAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, cos, sin, context_key, context_value, mask=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, context_key, context_value, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class MarkovHead(nn.Module):
    """B(x_{k−1}, ·) = W2·(g ⊙ W1[x_{k−1}]); g = 1 (vanilla) or σ(gate([h_k; W1[x]])) (gated)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, gated: bool) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self.gate_proj = nn.Linear(hidden_size + rank, rank) if gated else None

    def previous(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(token_ids.long())

    def bias(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        previous = self.previous(token_ids)
        if self.gate_proj is not None:
            previous = previous * torch.sigmoid(self.gate_proj(torch.cat((hidden, previous), dim=-1)))
        return self.markov_w2(previous)


class ConfidenceHead(nn.Module):
    """DeepSpec's AcceptRatePredictor: one linear unit; its logit, σ of which is c_k."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


@dataclass
class ContextCache:
    """Per backbone layer, the keys and values of the context positions fed so far (batch 1)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0


class DSparkModel(nn.Module):
    """The network; `draft_block` is the inference forward, `block_logits` its training form."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.dspark = config
        backbone = config.backbone
        self.embed_tokens = nn.Embedding(backbone.vocab_size, backbone.hidden_size)
        self.layers = nn.ModuleList(DSparkLayer(backbone) for _ in range(backbone.num_hidden_layers))
        self.norm = Qwen3RMSNorm(backbone.hidden_size, eps=backbone.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(backbone)
        self.fc = nn.Linear(config.feature_width, backbone.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(backbone.hidden_size, eps=backbone.rms_norm_eps)
        self.lm_head = nn.Linear(backbone.hidden_size, backbone.vocab_size, bias=False)
        self.markov_head = (MarkovHead(backbone.vocab_size, config.markov_rank, backbone.hidden_size,
                                       gated=config.markov_head_type == "gated")
                            if config.markov_rank else None)
        # per-position temperatures of the confidence head (checkpoint.py, training.py), or None
        self.calibration: list[float] | None = None
        # the checkpoint's directory (checkpoint.py), which a process compiling its block loads
        self.directory: Path | None = None
        self.confidence_head = None
        if config.enable_confidence_head:
            width = backbone.hidden_size + (config.markov_rank if config.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(width)

    @property
    def block_size(self) -> int:
        return self.dspark.block_size

    def _rope(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary_emb(like, positions)
        return cos.to(like.dtype), sin.to(like.dtype)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """[batch, tokens, feature_width] target features -> [batch, tokens, hidden]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def extend_context(self, cache: ContextCache, features: torch.Tensor) -> None:
        """Feed the target features of the next context positions ([1, tokens, feature_width])."""
        tokens = features.shape[1]
        if tokens == 0:
            return
        context = self.project_context(features)
        positions = torch.arange(cache.length, cache.length + tokens, device=features.device)[None]
        cos, sin = self._rope(context, positions)
        for index, layer in enumerate(self.layers):
            key, value = layer.self_attn.keys_values(context, cos, sin)
            if index < len(cache.keys):
                cache.keys[index] = torch.cat((cache.keys[index], key), dim=2)
                cache.values[index] = torch.cat((cache.values[index], value), dim=2)
            else:
                cache.keys.append(key)
                cache.values.append(value)
        cache.length += tokens

    def block_hidden(self, block_ids: torch.Tensor, start: torch.Tensor,
                     context_key: list[torch.Tensor], context_value: list[torch.Tensor],
                     mask: torch.Tensor | None = None) -> torch.Tensor:
        """The backbone over blocks [batch, γ] whose anchors sit at positions `start` [batch]."""
        hidden = self.embed_tokens(block_ids)
        positions = start[:, None] + torch.arange(block_ids.shape[1], device=block_ids.device)[None]
        cos, sin = self._rope(hidden, positions)
        for layer, key, value in zip(self.layers, context_key, context_value):
            hidden = layer(hidden, cos, sin, key, value, mask)
        return self.norm(hidden)

    def hidden_at(self, token_ids: torch.Tensor, positions: torch.Tensor,
                  context_key: list[torch.Tensor], context_value: list[torch.Tensor],
                  mask: torch.Tensor | None = None) -> torch.Tensor:
        """The backbone over tokens [batch, tokens] at explicit `positions` [batch, tokens].

        The training forward (training_forward.py) puts many blocks of one sequence in one call,
        each at its own anchor's positions, and keeps them apart with `mask`; `block_hidden` is
        the one-block-per-row case the drafter runs.
        """
        hidden = self.embed_tokens(token_ids)
        cos, sin = self._rope(hidden, positions)
        for layer, key, value in zip(self.layers, context_key, context_value):
            hidden = layer(hidden, cos, sin, key, value, mask)
        return self.norm(hidden)

    def markov_logits(self, base: torch.Tensor, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Base logits plus the transition bias from the previous token (any leading shape)."""
        if self.markov_head is None:
            return base
        return base + self.markov_head.bias(previous, hidden)

    def confidence_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """Logit of c_k from h_k and x_{k−1} (never x_k); None without a confidence head."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.dspark.confidence_head_with_markov:
            features = torch.cat((hidden, self.markov_head.previous(previous).to(hidden.dtype)), dim=-1)
        return self.confidence_head(features).float()

    def block_ids(self, anchor: torch.Tensor) -> torch.Tensor:
        """[batch, γ]: each anchor followed by γ−1 mask tokens."""
        block = anchor.new_full((anchor.shape[0], self.block_size), self.dspark.mask_token_id)
        block[:, 0] = anchor
        return block
