"""KV cache rollback: keep the accepted path, drop the rest, never re-encode the prefix.

Works on transformers' `DynamicCache` with full-attention `DynamicLayer`s (GPT-2, Llama, Qwen2
and most decoder-only models), whose tensors are [batch, kv_heads, seq_len, head_dim]. A
sliding-window layer gets the same full layer: it keeps what slid out of the window, so a rollback
across the window's edge has it, and the window is applied by the mask (windows.py).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from inference.engine.kv.slab import SlabLayer
from inference.engine.kv.windows import model_attention_layout


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache for `model`: one `SlabLayer` per layer, full and sliding-window alike.

    Refuses (UnsupportedModelError) layer kinds the engine cannot roll back (windows.py).
    """
    layout = model_attention_layout(model)
    cache = DynamicCache(config=model.config)
    # full layers, appended in place instead of concatenated (kv_slab.py)
    cache.layers = [SlabLayer() for _ in layout.layer_types]
    return cache


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Drop every cached token from position `length` on."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def keep_accepted(cache: DynamicCache, prefix_length: int, kept_offsets: list[int]) -> None:
    """Keep the first `prefix_length` tokens plus the tokens at `prefix_length + offset`.

    The offsets are the accepted nodes of a draft tree in path order. When they are simply
    0..k-1 (a chain, or a tree whose first branch won) this is a crop; otherwise the accepted
    nodes' keys and values are gathered behind the prefix.
    """
    if kept_offsets == list(range(len(kept_offsets))):
        truncate_cache(cache, prefix_length + len(kept_offsets))
        return
    index = None
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if index is None:
            index = torch.tensor([prefix_length + offset for offset in kept_offsets],
                                 dtype=torch.long, device=layer.keys.device)
        layer.keys = torch.cat(
            (layer.keys[:, :, :prefix_length], layer.keys.index_select(2, index)), dim=2)
        layer.values = torch.cat(
            (layer.values[:, :, :prefix_length], layer.values.index_select(2, index)), dim=2)
