"""The ragged batch cache of kv/ragged.py on preallocated memory, for a compiled forward.

Same contract as `RaggedCache` — rows of different lengths, a boolean `slots` matrix [rows, W]
saying which slots hold a token of the row's sequence, a forward that appends the same number of
slots to every row, rejected drafts and padding turned into holes that the mask hides — but the
keys and values live in a `KVPool` (runner/kv_pool.py) allocated once, and the forward is a
`ModelRunner`'s (runner/model_runner.py): compiled per shape bucket where a compiled graph is
ready, the same function run eagerly where not. The pool never grows, so a forward that would
run past its capacity compacts the rows first (their holes squeezed out).

Masks are tensors built here, outside the compiled region: [rows, 1, new, W] over the cached
slots and [rows, 1, new, new] among the new tokens (a tree's ancestors, or causal), with the
sliding window's pair beside them for a model that has one.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from inference.engine.errors import EngineError
from inference.engine.kv.ragged import RowInput
from inference.engine.kv.windows import model_attention_layout
from inference.engine.runner.model_runner import ForwardBatch, ModelRunner


class StaticRaggedCache:
    """A batched KV cache in a preallocated pool; see the module docstring and `RaggedCache`."""

    packed = False  # the compiled forward pads rows; packing is the eager path's (modeling.Packing)

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.model: PreTrainedModel = runner.model
        self.pool = runner.new_pool()
        # [rows, W] which slots hold a token of the row's sequence
        self.slots = torch.zeros(0, 0, dtype=torch.bool)
        self.last_start = 0  # the slot index of the first token the last forward appended
        self.last_logits: torch.Tensor | None = None  # [rows (padded), T (padded), vocab] of the last forward
        self._tokens = 0  # slots holding a token (kept as slots change: `holes` runs every step)
        self._window = model_attention_layout(self.model).window

    @property
    def rows(self) -> int:
        return self.slots.shape[0]

    @property
    def width(self) -> int:
        return self.slots.shape[1]

    def lengths(self) -> list[int]:
        return self.slots.sum(dim=1).tolist()

    def _check_room(self, rows: int) -> None:
        if rows > self.pool.rows:
            raise EngineError(f"the KV pool holds {self.pool.rows} rows; a {rows}th was asked for")

    def add_row(self) -> int:
        """Append an empty row (every slot a hole); return its index."""
        self._check_room(self.rows + 1)
        self.slots = torch.cat((self.slots, torch.zeros(1, self.width, dtype=torch.bool)))
        return self.rows - 1

    def _widen_to(self, width: int) -> None:
        if width > self.width:
            if width > self.pool.capacity:
                raise EngineError(f"a row of {width} tokens exceeds the KV pool's {self.pool.capacity} slots")
            self.slots = torch.cat((self.slots, torch.zeros(self.rows, width - self.width, dtype=torch.bool)), dim=1)

    def adopt_row(self, other: StaticRaggedCache, row: int) -> int:
        """Append row `row` of `other` (another cache of the same model) as a new row, its holes squeezed out."""
        index = other.slots[row].nonzero()[:, 0]
        keys, values = other.pool.gather_row(row, index)
        return self.add_row_with_pool(keys, values)

    def add_row_with_pool(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Append a row whose sequence starts with [layers, kv_heads, n, head_dim] keys and values."""
        length = keys.shape[2]
        self._widen_to(length)
        new = self.add_row()
        if length:
            self.pool.put_row(new, keys, values)
            self.slots[new, :length] = True
            self._tokens += length
        return new

    def row_prefix(self, row: int, length: int, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Tokens `start`..`length` of the row's sequence per layer, (keys, values) [kv_heads, tokens, dim]:
        the prefix cache's format (kv/prefix_cache.py), the same as `RaggedCache.row_prefix`."""
        index = self.slots[row].nonzero()[start:length, 0]
        keys, values = self.pool.gather_row(row, index)
        return [(keys[layer], values[layer]) for layer in range(keys.shape[0])]

    def add_row_with(self, layers: list[tuple[torch.Tensor, torch.Tensor] | None], length: int) -> int:
        """Append a row whose sequence starts with `length` tokens given per layer (as `row_prefix` gives)."""
        if length == 0 or any(layer is None for layer in layers):
            if length:
                raise EngineError("a cached prefix without every layer cannot seed a static cache row")
            return self.add_row()
        keys = torch.stack([layer[0] for layer in layers])
        values = torch.stack([layer[1] for layer in layers])
        return self.add_row_with_pool(keys[:, :, :length], values[:, :, :length])

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only `rows`, in that order (the others leave the batch)."""
        self.pool.keep_rows(rows, self.slots.shape[1])
        self.slots = self.slots[rows] if rows else torch.zeros(0, 0, dtype=torch.bool)
        self._tokens = int(self.slots.sum())
        if not rows:
            self.reset()

    def reset(self) -> None:
        self.slots = torch.zeros(0, 0, dtype=torch.bool)
        self._tokens = 0

    def row_slots(self, row: int) -> list[int]:
        return self.slots[row].nonzero()[:, 0].tolist()

    def drop(self, row: int, slots: list[int]) -> None:
        """Turn `slots` of `row` into holes; slots at the end that are holes in every row are cut off."""
        if slots:
            self._tokens -= int(self.slots[row, slots].sum())
            self.slots[row, slots] = False
            if max(slots) == self.width - 1:
                used = self.slots.any(dim=0).nonzero()
                width = int(used[-1]) + 1 if used.numel() else 0
                self.slots = self.slots[:, :width]

    def truncate_row(self, row: int, length: int) -> None:
        self.drop(row, self.row_slots(row)[length:])

    def holes(self) -> int:
        return self.width * self.rows - self._tokens

    def compact(self) -> None:
        """Move every row's tokens to the front; the width becomes the longest row's length."""
        lengths = self.lengths()
        longest = max(lengths, default=0)
        if longest == self.width:
            return
        index = torch.zeros(self.rows, longest, dtype=torch.long)
        slots = torch.zeros(self.rows, longest, dtype=torch.bool)
        for row, length in enumerate(lengths):
            index[row, :length] = self.slots[row].nonzero()[:, 0]
            slots[row, :length] = True
        self.pool.compact(self.rows, index)
        self.slots = slots

    def maybe_compact(self, max_hole_share: float = 0.5, min_width: int = 64) -> bool:
        if self.width >= min_width and self.holes() > max_hole_share * self.width * self.rows:
            self.compact()
            return True
        return False

    def forward(self, inputs: list[RowInput], logits: str = "all",
                device_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Run every row's new tokens in one forward; each row's logits [new, vocab] ("all"),
        [1, vocab] after its last new token ("last"), or nothing ("none"). device_ids: as
        `RaggedCache.forward`'s (ids already on the device); `last_logits` the whole output."""
        if len(inputs) != self.rows:
            raise ValueError(f"{len(inputs)} inputs for {self.rows} rows")
        new = max((len(item.token_ids) for item in inputs), default=0)
        if new == 0:
            return [torch.empty(0) for _ in inputs]
        if self.width + new > self.pool.capacity:
            self.compact()
            if self.width + new > self.pool.capacity:
                raise EngineError(f"{self.width} cached + {new} new slots exceed the KV pool's {self.pool.capacity}")
        batch = self._batch(inputs, new, logits)
        if device_ids is not None:
            batch.input_ids = device_ids
        output = self.runner.forward(self.pool, batch)
        self.last_logits = output.logits
        counts = [len(item.token_ids) for item in inputs]
        self.slots = torch.cat((self.slots, torch.arange(new)[None, :] < torch.tensor(counts)[:, None]), dim=1)
        self._tokens += sum(counts)
        self.last_start = batch.width
        if logits == "none":
            return []
        if logits == "last":
            return list(output.logits[:self.rows])
        return [output.logits[row, :len(item.token_ids)] for row, item in enumerate(inputs)]

    @property
    def last_features(self) -> torch.Tensor | None:
        """[rows, new, taps * hidden] the tapped layers' hidden states of the last forward."""
        return self.runner.last_features

    def _batch(self, inputs: list[RowInput], new: int, logits: str) -> ForwardBatch:
        """The tensors of one forward: ids, positions, the split masks (see the module docstring)."""
        width = self.width
        counts = [len(item.token_ids) for item in inputs]
        input_ids = torch.tensor([item.token_ids + [0] * (new - count) for item, count in zip(inputs, counts)],
                                 dtype=torch.long)
        position_ids = torch.tensor([list(item.positions) + [0] * (new - count)
                                     for item, count in zip(inputs, counts)], dtype=torch.long)
        # [rows, new] which new slots hold a token
        valid = torch.arange(new)[None, :] < torch.tensor(counts)[:, None]
        # [rows, new, W] a token sees its row's sequence; [rows, new, new] the new tokens before it
        # (a padding query sees only itself, so its softmax has a key)
        cached = self.slots[:, None, :] & valid[:, :, None]
        among = (torch.ones(new, new, dtype=torch.bool).tril_() & valid[:, :, None]) | torch.eye(new, dtype=torch.bool)
        for row, (item, count) in enumerate(zip(inputs, counts)):
            if count and item.cached_visible is not None:
                cached[row, :count] = item.cached_visible
            if count and item.new_mask is not None:
                among[row, :count, :count] = item.new_mask
        window = None
        if self._window is not None:
            # a slot's position is its rank in the row (holes hold no position)
            key_positions = self.slots.cumsum(dim=1) - 1
            window = (position_ids[:, :, None] - key_positions[:, None, :] < self._window,
                      position_ids[:, :, None] - position_ids[:, None, :] < self._window)
        last_index = torch.tensor([max(count - 1, 0) for count in counts], dtype=torch.long)
        return ForwardBatch(input_ids, position_ids, cached, among, width, new, window,
                            last_index if logits == "last" else None, logits)
