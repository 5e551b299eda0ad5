"""Sliding-window attention on caches that keep every token: the window lives in the mask.

transformers' sliding-window cache layers (`DynamicSlidingWindowLayer`) drop the keys that slid
out of the window. Speculation undoes rejected drafts, and a draft that crossed the window's edge
and is undone needs keys the layer already dropped. So the engine's caches keep a sequence's every
token in every layer (the same `SlabLayer`s as full attention: rollback, crop, adoption and
compaction unchanged), and each sliding-window layer is told by its mask what it may see: a query
at position q sees a key at position k only when q - k < window (transformers'
`sliding_window_overlay`), on top of whatever the engine's mask allows (holes, tree ancestors).
The cost is memory: the whole sequence per layer, as a full-attention layer holds.

A model whose layers all slide with one window takes the windowed 4-D mask; a model mixing full
and sliding layers (Gemma 2 and 3, Qwen2/3 with `use_sliding_window`) takes a dict keyed by layer
type, which its forward reads per layer (`config.layer_types`). Other layer kinds (chunked,
linear attention, recurrent states) are refused with a one-line reason.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from inference.engine.errors import UnsupportedModelError

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class AttentionLayout:
    """Which attention each decoder layer runs, and the sliding layers' window (None: no window)."""

    layer_types: tuple[str, ...]
    window: int | None

    @property
    def sliding(self) -> bool:
        return self.window is not None

    @property
    def hybrid(self) -> bool:
        """Full and sliding layers in one model: masks go per layer type."""
        return self.sliding and FULL in self.layer_types


def attention_layout(config: PretrainedConfig) -> AttentionLayout:
    """The layout of a config's decoder; UnsupportedModelError (one line) for what the engine cannot serve."""
    decoder = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(decoder)
    windows = set()
    resolved = []
    for layer_type, kwargs in zip(layer_types, layer_kwargs):
        if layer_type == SLIDING and kwargs.get("sliding_window") is None:
            layer_type = FULL  # a sliding layer without a window sees everything
        if layer_type == SLIDING:
            windows.add(int(kwargs["sliding_window"]))
        resolved.append(layer_type)
    name = decoder.model_type
    others = sorted(set(resolved) - {FULL, SLIDING})
    if others:
        raise UnsupportedModelError(
            f"{name} has {', '.join(others)} layers; the engine serves full and sliding-window attention only")
    if len(windows) > 1:
        raise UnsupportedModelError(
            f"{name} has sliding layers of different windows ({sorted(windows)}); the engine serves one window")
    layout = AttentionLayout(tuple(resolved), windows.pop() if windows else None)
    if layout.hybrid and getattr(decoder, "layer_types", None) is None:
        raise UnsupportedModelError(
            f"{name} mixes full and sliding-window layers without config.layer_types; its forward "
            "cannot take a mask per layer type")
    return layout


_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_attention_layout(model: PreTrainedModel) -> AttentionLayout:
    """`attention_layout` of a loaded model, computed once per model."""
    layout = _layouts.get(model)
    if layout is None:
        layout = _layouts[model] = attention_layout(model.config)
    return layout


def windowed_masks(
    layout: AttentionLayout,
    # [rows, 1, new, cached + new] additive (0 = may attend), or None: plain causal by position
    attention_mask: torch.Tensor | None,
    # [rows, new] the new tokens' positions
    query_positions: torch.Tensor,
    # [rows, cached] the cached slots' positions (a hole's is never read: the mask hides it)
    key_positions: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask(s) a sliding-window model's forward takes: the engine's mask plus the window."""
    # [rows, cached + new]
    keys = torch.cat((key_positions.to(query_positions.device), query_positions), dim=1)
    # [rows, new, cached + new]
    distance = query_positions[:, :, None] - keys[:, None, :]
    minimum = torch.finfo(dtype).min
    if attention_mask is None:
        attention_mask = torch.zeros(distance.shape, dtype=dtype, device=distance.device)
        attention_mask = attention_mask.masked_fill_(distance < 0, minimum)[:, None]
    sliding = attention_mask.masked_fill(~(distance < layout.window)[:, None], minimum)
    if layout.hybrid:
        return {FULL: attention_mask, SLIDING: sliding}
    return sliding
