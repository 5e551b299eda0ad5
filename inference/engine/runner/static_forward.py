"""The target's forward as one pure function of tensors, for compiling whole.

`StaticForward` runs a Llama-layout decoder (Llama, Qwen2, Qwen3, Mistral, with or without a
sliding window) over a KV cache it does not own and does not change: the cached keys and values
come in as tensors (views of the runner's preallocated pool, kv_pool.py), the new tokens' keys
and values go out, and the caller writes them into the pool. No Python decides anything from a
tensor's value, and every shape is read from the inputs, so `torch.export` traces it once per
kind and AOTInductor compiles it into one graph whose sizes (rows, new tokens, cached slots) are
symbols: a bucket's forward needs no new compile.

Attention splits the keys in two: the cached slots and the new tokens. The scores against
both are concatenated (a [rows, kv_heads, group * new, cached + new] matrix, small next to the
cache) so a softmax sees them together, and the output is the sum of the two products, so the
cache is read once and never copied (a `torch.cat` of cache and new keys would copy the cache
every layer of every forward). Grouped-query heads share their keys without `repeat_kv`: the
queries of a group are stacked along the query axis.

The masks are additive (0 where a query may look, the dtype's minimum elsewhere), split the
same way: [rows, 1, new, cached] and [rows, 1, new, new]. A model with sliding-window layers
takes a second pair for those layers (kv/windows.py puts the window in the mask).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers import PreTrainedModel

from inference.engine.kv.windows import SLIDING, model_attention_layout
from inference.engine.lm.features import EMBEDDING_LAYER

# Families whose decoder layers this forward runs op for op (the same layout as modeling.py's
# lean path, sliding windows included: the window is in the mask).
STATIC_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})

LOGITS_ALL = "all"  # every new token's logits: a verify
LOGITS_LAST = "last"  # one position per row (`last_index`): a prefill chunk


def static_forward_refusal(model: PreTrainedModel) -> str | None:
    """Why `model` cannot run on the static forward (None: it can), in one line for the log."""
    config = model.config
    inner = getattr(model, "model", None)
    if config.model_type not in STATIC_MODEL_TYPES:
        return f"{config.model_type} is not a Llama-layout family ({', '.join(sorted(STATIC_MODEL_TYPES))})"
    if not all(hasattr(inner, name) for name in ("embed_tokens", "rotary_emb", "layers", "norm")):
        return f"{type(model).__name__} lacks the Llama-layout modules"
    if not all(hasattr(layer.mlp, name) for layer in inner.layers for name in ("gate_proj", "up_proj", "down_proj")):
        return f"{type(model).__name__}'s MLP is not gated (gate/up/down)"
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return f"{type(model).__name__}'s head is not a plain linear layer"
    if getattr(config, "final_logit_softcapping", None) is not None:
        return "the model soft-caps its logits"
    if model.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return f"dtype {model.dtype} (a quantised variant) is not compiled"
    return None


class StaticForward(nn.Module):
    """forward(input_ids, position_ids, mask_cached, mask_new, keys, values, window_cached,
    window_new, last_index) -> (logits, new_keys, new_values[, features]); see the module docstring.
    The window masks are None for a model without a sliding window, `last_index` for LOGITS_ALL
    (a compiled package takes the tensors alone, in this order).

    Shapes (R rows, T new tokens per row, L cached slots, N layers, K kv heads, D head size):
      input_ids, position_ids [R, T] int64; mask_cached [R, 1, T, L]; mask_new [R, 1, T, T];
      keys, values [R, N, K, L, D]; last_index [R] int64 (LOGITS_LAST only);
      logits [R, T, vocab] (LOGITS_ALL) or [R, 1, vocab]; new_keys, new_values [R, N, K, T, D];
      features [R, T, len(tap_layers) * hidden] when `tap_layers` is given.
    """

    def __init__(self, model: PreTrainedModel, logits: str = LOGITS_ALL,
                 tap_layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        refusal = static_forward_refusal(model)
        if refusal is not None:
            raise ValueError(refusal)
        self.model = model
        self.logits = logits
        self.tap_layers = tuple(tap_layers)
        layout = model_attention_layout(model)
        self.sliding_layers = tuple(kind == SLIDING for kind in layout.layer_types)
        self.windowed = any(self.sliding_layers)
        self.layer_count = model.config.num_hidden_layers
        first = model.model.layers[0].self_attn
        self._rotary = sys.modules[type(first).__module__].apply_rotary_pos_emb
        # scores and softmax in float32 at least (as SDPA accumulates), back to the model's dtype
        self.score_dtype = torch.promote_types(model.dtype, torch.float32)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask_cached: torch.Tensor,
                mask_new: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                window_cached: torch.Tensor | None = None, window_new: torch.Tensor | None = None,
                last_index: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        inner = self.model.model
        rows, new = input_ids.shape
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)
        taps: dict[int, torch.Tensor] = {}
        if EMBEDDING_LAYER in self.tap_layers:
            taps[EMBEDDING_LAYER] = hidden
        new_keys, new_values = [], []
        for index in range(self.layer_count):
            layer = inner.layers[index]
            sliding = self.sliding_layers[index]
            hidden, key, value = self._layer(
                layer, hidden, cos, sin, keys[:, index], values[:, index],
                window_cached if sliding else mask_cached, window_new if sliding else mask_new)
            new_keys.append(key)
            new_values.append(value)
            if index in self.tap_layers:
                taps[index] = hidden
        hidden = inner.norm(hidden)
        if self.logits == LOGITS_LAST:
            hidden = hidden[torch.arange(rows, device=hidden.device), last_index][:, None]
        outputs = (self.model.lm_head(hidden), torch.stack(new_keys, dim=1), torch.stack(new_values, dim=1))
        if self.tap_layers:
            outputs += (torch.cat([taps[layer] for layer in self.tap_layers], dim=-1),)
        return outputs

    def _layer(self, layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               # [R, K, L, D]
               cached_keys: torch.Tensor, cached_values: torch.Tensor,
               # [R, 1, T, L] and [R, 1, T, T]
               mask_cached: torch.Tensor, mask_new: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attention = layer.self_attn
        head = attention.head_dim
        rows, new, _ = hidden.shape
        residual = hidden
        hidden = layer.input_layernorm(hidden)
        # [R, T, heads, D]: the rotation on this layout, so the query groups stack without a copy
        query = attention.q_proj(hidden).view(rows, new, -1, head)
        key = attention.k_proj(hidden).view(rows, new, -1, head)
        value = attention.v_proj(hidden).view(rows, new, -1, head)
        if getattr(attention, "q_norm", None) is not None:  # Qwen3: RMSNorm per head, before the rotation
            query, key = attention.q_norm(query), attention.k_norm(key)
        query, key = self._rotary(query, key, cos, sin, unsqueeze_dim=2)
        kv_heads, heads = key.shape[2], query.shape[2]
        group = heads // kv_heads
        key, value = key.transpose(1, 2), value.transpose(1, 2)  # [R, K, T, D]
        # [R, K, group * T, D]: a kv head's query heads one after the other
        grouped = query.view(rows, new, kv_heads, group, head).permute(0, 2, 3, 1, 4).reshape(
            rows, kv_heads, group * new, head)
        work = self.score_dtype  # products in the model's dtype, the softmax in `work`
        cached_length = cached_keys.shape[2]
        scores = torch.cat((grouped @ cached_keys.transpose(-1, -2), grouped @ key.transpose(-1, -2)),
                           dim=-1).to(work) * attention.scaling
        mask = torch.cat((mask_cached, mask_new), dim=-1).to(work)
        scores = scores.view(rows, kv_heads, group, new, cached_length + new) + mask[:, :, None]
        probs = torch.softmax(scores, dim=-1).to(hidden.dtype).view(
            rows, kv_heads, group * new, cached_length + new)
        output = probs[..., :cached_length] @ cached_values + probs[..., cached_length:] @ value
        # back to [R, T, heads * D]
        output = output.view(rows, kv_heads, group, new, head).permute(0, 3, 1, 2, 4).reshape(
            rows, new, heads * head)
        hidden = residual + attention.o_proj(output)
        residual = hidden
        hidden = layer.post_attention_layernorm(hidden)
        mlp = layer.mlp
        hidden = residual + mlp.down_proj(mlp.act_fn(mlp.gate_proj(hidden)) * mlp.up_proj(hidden))
        return hidden, key, value
