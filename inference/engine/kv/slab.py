"""A KV cache layer whose keys and values have spare capacity, so a forward appends in place.

transformers' `DynamicLayer.update` concatenates: every forward copies the layer's whole cache
(`torch.cat`), which for a batch of rows with a few hundred slots each is most of a step's
memory traffic on a CPU (measured: 8 rows x 5 new tokens on a 200-slot cache, 20 layers, the
copies were ~7 % of the forward; with `repeat_kv` ~27 %). vLLM and SGLang preallocate their
caches for the same reason. `SlabLayer` keeps each tensor in a buffer that grows by half when
full and hands out views of its filled prefix; everything that assigns `layer.keys` /
`layer.values` (crop, row selection, compaction) keeps working: assigning a prefix view of the
buffer only shortens it, any other tensor becomes the new buffer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

# Slots a buffer gains beyond half its size when it grows.
_GROWTH_SLOTS = 32


def _is_prefix_view(view: torch.Tensor | None, buffer: torch.Tensor | None) -> bool:
    """Whether `view` is `buffer[:, :, :n]` for some n (same storage start, strides and shape)."""
    return (view is not None and buffer is not None and view.dim() == 4 and buffer.dim() == 4
            and view.data_ptr() == buffer.data_ptr() and view.stride() == buffer.stride()
            and view.shape[:2] == buffer.shape[:2] and view.shape[3] == buffer.shape[3]
            and view.shape[2] <= buffer.shape[2])


class SlabLayer(DynamicLayer):
    """A `DynamicLayer` whose [rows, kv_heads, slots, head_dim] tensors are prefixes of larger buffers."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor | None] = {"keys": None, "values": None}
        self._lengths = {"keys": 0, "values": 0}
        super().__init__()

    def _filled(self, name: str) -> torch.Tensor | None:
        buffer = self._buffers[name]
        if buffer is None or buffer.dim() != 4:
            return buffer
        return buffer[:, :, :self._lengths[name]]

    def _assign(self, name: str, value: torch.Tensor | None) -> None:
        if _is_prefix_view(value, self._buffers[name]):
            self._lengths[name] = value.shape[2]
            return
        self._buffers[name] = value
        self._lengths[name] = value.shape[2] if value is not None and value.dim() == 4 else 0

    keys = property(lambda self: self._filled("keys"), lambda self, value: self._assign("keys", value))
    values = property(lambda self: self._filled("values"), lambda self, value: self._assign("values", value))

    def _append(self, name: str, states: torch.Tensor) -> None:
        buffer, length = self._buffers[name], self._lengths[name]
        if buffer is None or buffer.dim() != 4:
            buffer, length = states.new_empty((*states.shape[:2], 0, states.shape[3])), 0
        new = states.shape[2]
        if length + new > buffer.shape[2]:
            capacity = max(length + new, buffer.shape[2] * 3 // 2 + _GROWTH_SLOTS)
            grown = states.new_empty((*states.shape[:2], capacity, states.shape[3]))
            grown[:, :, :length] = buffer[:, :, :length]
            buffer = grown
        buffer[:, :, length:length + new] = states
        self._buffers[name], self._lengths[name] = buffer, length + new

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._append("keys", key_states)
        self._append("values", value_states)
        return self.keys, self.values
