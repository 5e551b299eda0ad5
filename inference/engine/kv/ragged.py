"""One KV cache shared by many sequences of different lengths: holes are masked, never re-encoded.

transformers' `DynamicCache` keeps one length for every batch row. Rows of a speculative batch
accept different numbers of tokens per step, start at different times and leave when they are
done, so the cache here is a `DynamicCache` of width `L` plus a boolean `slots` matrix
[rows, L] that says which slots hold a token of the row's sequence. A forward appends the same
number of slots `T` to every row (rows with fewer new tokens are padded), builds the additive
4-D mask [rows, 1, T, L + T] from `slots` and the per-row masks among the new tokens, and
takes explicit per-row `position_ids`, so a row's hidden states are exactly those of its own
sequence run alone. Rejected draft tokens and padding become holes (`slots` false);
`compact()` squeezes them out when they grow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from inference.engine.kv.rollback import new_cache
from inference.engine.kv.windows import model_attention_layout
from inference.engine.lm.modeling import forward_batch_logits


@dataclass
class RowInput:
    """What one row feeds in one forward.

    token_ids: the new tokens; positions: their position ids (the row's own, not the slot index).
    new_mask: [new, new] bool, which new tokens each new token may see (None: causal).
    cached_visible: [new, L] bool, which cached slots each new token may see (None: every slot
    of the row's sequence). A row with no tokens is padding for this forward.
    """

    token_ids: list[int]
    positions: list[int]
    new_mask: torch.Tensor | None = None
    cached_visible: torch.Tensor | None = None


class RaggedCache:
    """A batched KV cache whose rows hold sequences of different lengths."""

    def __init__(self, model: PreTrainedModel, packed: bool = False) -> None:
        self.model = model
        # the linear layers take the real tokens only, not the padding (modeling.py `Packing`):
        # opt-in, as it changes low bits (see `Packing`)
        self.packed = packed
        self.cache = new_cache(model)
        # [rows, L] which slots hold a token of the row's sequence
        self.slots = torch.zeros(0, 0, dtype=torch.bool)
        # the slot index of the first token the last forward appended
        self.last_start = 0
        self.last_logits: torch.Tensor | None = None  # [rows, T, vocab] of the last forward

    @property
    def rows(self) -> int:
        return self.slots.shape[0]

    @property
    def width(self) -> int:
        return self.slots.shape[1]

    def lengths(self) -> list[int]:
        """Tokens held per row."""
        return self.slots.sum(dim=1).tolist()

    def _layers(self):
        return [layer for layer in self.cache.layers if layer.is_initialized and layer.keys.numel()]

    def add_row(self) -> int:
        """Append an empty row (every slot a hole); return its index."""
        self.slots = torch.cat((self.slots, torch.zeros(1, self.width, dtype=torch.bool)))
        for layer in self._layers():
            shape = (1, *layer.keys.shape[1:])
            layer.keys = torch.cat((layer.keys, layer.keys.new_zeros(shape)))
            layer.values = torch.cat((layer.values, layer.values.new_zeros(shape)))
        return self.rows - 1

    def adopt_row(self, other: RaggedCache, row: int) -> int:
        """Append row `row` of `other` (another cache of the same model) as a new row; return its index.

        The row's keys and values are copied in sequence order to the front of the new row (its
        holes in `other` are squeezed out); the cache widens with holes if the row is longer.
        """
        index = other.slots[row].nonzero()[:, 0]
        length = int(index.numel())
        if length > self.width:
            self._widen(length - self.width)
        new = self.add_row()
        if length == 0:
            return new
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            if not theirs.is_initialized or not theirs.keys.numel():
                continue
            if not mine.is_initialized or not mine.keys.numel():
                # the first keys of this cache: zeros (holes) for the rows it already has
                mine.lazy_initialization(theirs.keys, theirs.values)
                mine.keys = theirs.keys.new_zeros(self.rows, theirs.keys.shape[1], self.width,
                                                  theirs.keys.shape[3])
                mine.values = theirs.values.new_zeros(self.rows, theirs.values.shape[1], self.width,
                                                      theirs.values.shape[3])
            device_index = index.to(theirs.keys.device)
            mine.keys[new, :, :length] = theirs.keys[row].index_select(1, device_index)
            mine.values[new, :, :length] = theirs.values[row].index_select(1, device_index)
        self.slots[new, :length] = True
        return new

    def row_prefix(self, row: int, length: int, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Tokens `start`..`length` of the row's sequence, per layer (keys, values) [kv_heads,
        tokens, dim] (copies, holes squeezed out; None for a layer never filled): what the prefix
        cache stores (prefix_cache.py)."""
        index = self.slots[row].nonzero()[start:length, 0]
        layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for layer in self.cache.layers:
            if not layer.is_initialized or not layer.keys.numel():
                layers.append(None)
                continue
            device_index = index.to(layer.keys.device)
            layers.append((layer.keys[row].index_select(1, device_index),
                           layer.values[row].index_select(1, device_index)))
        return layers

    def add_row_with(self, layers: list[tuple[torch.Tensor, torch.Tensor] | None], length: int) -> int:
        """Append a row whose sequence starts with `length` tokens of keys and values given per
        layer ([kv_heads, length, dim], as `row_prefix` returns them); return its index."""
        if length > self.width:
            self._widen(length - self.width)
        new = self.add_row()
        if length == 0:
            return new
        for mine, given in zip(self.cache.layers, layers):
            if given is None:
                continue
            keys, values = given
            if not mine.is_initialized or not mine.keys.numel():
                # the first keys of this cache: zeros (holes) for the rows it already has
                mine.lazy_initialization(keys[None], values[None])
                mine.keys = keys.new_zeros(self.rows, keys.shape[0], self.width, keys.shape[2])
                mine.values = values.new_zeros(self.rows, values.shape[0], self.width, values.shape[2])
            mine.keys[new, :, :length] = keys.to(mine.keys.device)
            mine.values[new, :, :length] = values.to(mine.values.device)
        self.slots[new, :length] = True
        return new

    def _widen(self, extra: int) -> None:
        """Add `extra` hole slots at the end of every row."""
        self.slots = torch.cat((self.slots, torch.zeros(self.rows, extra, dtype=torch.bool)), dim=1)
        for layer in self._layers():
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                pad = tensor.new_zeros(tensor.shape[0], tensor.shape[1], extra, tensor.shape[3])
                setattr(layer, name, torch.cat((tensor, pad), dim=2))

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only `rows`, in that order (the others leave the batch)."""
        index = torch.tensor(rows, dtype=torch.long)
        self.slots = self.slots.index_select(0, index)
        for layer in self._layers():
            device_index = index.to(layer.keys.device)
            layer.keys = layer.keys.index_select(0, device_index)
            layer.values = layer.values.index_select(0, device_index)
        if not rows:
            self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        self.slots = torch.zeros(0, 0, dtype=torch.bool)

    def row_slots(self, row: int) -> list[int]:
        """Slot indices of the row's sequence, in order."""
        return self.slots[row].nonzero()[:, 0].tolist()

    def drop(self, row: int, slots: list[int]) -> None:
        """Turn `slots` of `row` into holes (rejected drafts, tree nodes, padding).

        Slots at the end that are holes in every row are cut off (the next forward writes over
        them), so a lone row's cache stays hole-free and a batch's grows only by what a row kept.
        """
        if slots:
            self.slots[row, slots] = False
            if max(slots) == self.width - 1:
                self._cut_trailing_holes()

    def _cut_trailing_holes(self) -> None:
        used = self.slots.any(dim=0).nonzero()
        width = max(int(used[-1]) + 1 if used.numel() else 0, 1)  # a 0-wide layer loses its rows
        if width >= self.width:
            return
        self.slots = self.slots[:, :width]
        for layer in self._layers():
            layer.keys = layer.keys[:, :, :width]  # a prefix view: SlabLayer only shortens
            layer.values = layer.values[:, :, :width]

    def truncate_row(self, row: int, length: int) -> None:
        """Keep the first `length` tokens of the row's sequence."""
        self.drop(row, self.row_slots(row)[length:])

    def holes(self) -> int:
        return self.width * self.rows - int(self.slots.sum())

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
        for layer in self._layers():
            device_index = index.to(layer.keys.device)
            gather = device_index[:, None, :, None].expand(-1, layer.keys.shape[1], -1,
                                                            layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.slots = slots

    def maybe_compact(self, max_hole_share: float = 0.5, min_width: int = 64) -> bool:
        """Compact when holes are more than `max_hole_share` of a cache at least `min_width` wide."""
        if self.width >= min_width and self.holes() > max_hole_share * self.width * self.rows:
            self.compact()
            return True
        return False

    def _ragged_inputs(self, inputs: list[RowInput], new: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded ids and positions [rows, new], the new slots [rows, new] and the additive mask.

        Built with whole-batch tensor ops (a per-row loop of slice assignments cost ~0.4 ms a
        forward at 8 rows, a tenth of a one-layer draft forward); only rows with their own masks
        (trees, `cached_visible`) are filled one by one.
        """
        width = self.width
        counts = [len(item.token_ids) for item in inputs]
        input_ids = torch.tensor([item.token_ids + [0] * (new - count) for item, count in zip(inputs, counts)],
                                 dtype=torch.long)
        position_ids = torch.tensor([list(item.positions) + [0] * (new - count)
                                     for item, count in zip(inputs, counts)], dtype=torch.long)
        # [rows, new] which new slots hold a token (the rest pad the row to the forward's width)
        valid = torch.arange(new)[None, :] < torch.tensor(counts)[:, None]
        # [rows, new, width + new]: a token sees its row's sequence and the new tokens before it;
        # a padding query sees only itself (so softmax has a key)
        allowed = torch.cat((self.slots[:, None, :] & valid[:, :, None],
                             torch.ones(new, new, dtype=torch.bool).tril_() & valid[:, :, None]
                             | torch.eye(new, dtype=torch.bool)), dim=2)
        for row, (item, count) in enumerate(zip(inputs, counts)):
            if count and item.cached_visible is not None:
                allowed[row, :count, :width] = item.cached_visible
            if count and item.new_mask is not None:
                allowed[row, :count, width:width + count] = item.new_mask
        dtype = self.model.dtype
        # [rows, 1, new, width + new]
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        return input_ids, position_ids, valid, mask[:, None].to(self.model.device)

    def _plain_causal(self, inputs: list[RowInput]) -> bool:
        """One row, no holes, a chain of new tokens at the positions that follow: a plain causal forward."""
        if len(inputs) != 1:
            return False
        item = inputs[0]
        return (item.new_mask is None and item.cached_visible is None
                and item.positions == list(range(self.width, self.width + len(item.token_ids)))
                and bool(self.slots.all()))

    def forward(self, inputs: list[RowInput], logits: str = "all",
                device_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Run every row's new tokens in one forward; return each row's logits, [new, vocab].

        Every row gains T = max(new tokens) slots; a row's slots beyond its own tokens are holes.
        logits="last": each row's after its last new token only, [1, vocab] (a row with no new
        token gets a meaningless row); "none": the cache is filled, no logits computed or returned.
        device_ids: [rows, T] the token ids, already on the model's device (drafts drawn there:
        batch/device_step.py); the inputs' own ids only say how many each row feeds.
        `last_logits` keeps the whole [rows, T, vocab] of an "all" forward.
        """
        if len(inputs) != self.rows:
            raise ValueError(f"{len(inputs)} inputs for {self.rows} rows")
        new = max((len(row.token_ids) for row in inputs), default=0)
        if new == 0:
            return [torch.empty(0) for _ in inputs]
        width = self.width
        device = self.model.device
        if self._plain_causal(inputs):
            # the model's own causal attention: the same values, no mask to build or apply
            input_ids = torch.tensor([inputs[0].token_ids], dtype=torch.long)
            position_ids = torch.tensor([inputs[0].positions], dtype=torch.long)
            new_slots = torch.ones(1, new, dtype=torch.bool)
            mask = None
        else:
            input_ids, position_ids, new_slots, mask = self._ragged_inputs(inputs, new)
        # [rows, new, vocab]
        last_index = torch.tensor([max(len(item.token_ids) - 1, 0) for item in inputs], device=device)
        options = {"token_mask": new_slots.to(device)} if self.packed else {}
        if mask is not None and model_attention_layout(self.model).sliding:
            # a sliding window counts positions, not slots: a slot's is its rank in the row
            options["key_positions"] = (self.slots.cumsum(dim=1) - 1).to(device)
        if device_ids is not None:
            input_ids = device_ids
        output = forward_batch_logits(self.model, input_ids.to(device), self.cache, mask,
                                      position_ids.to(device), logits, last_index, **options)
        self.slots = torch.cat((self.slots, new_slots), dim=1)
        self.last_start = width
        self.last_logits = output
        if logits == "none":
            return []
        if logits == "last":
            return list(output)
        return [output[row, :len(item.token_ids)] for row, item in enumerate(inputs)]
