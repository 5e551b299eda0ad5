"""Keys and values of every layer in one preallocated tensor each, sized once from a budget.

A compiled forward wants inputs whose storage never moves and whose shapes come from a small
set: `KVPool` holds [rows, layers, kv_heads, capacity, head_dim] for keys and for values (rows
first, so a view of the first rows has the same strides whatever the pool's row count: a
compiled package depends on the capacity, not on how many rows a worker runs),
allocated when the engine is built and never grown. The batch's row i is the pool's row i (rows
that leave are squeezed out by moving the rows behind them forward), and a row's sequence lives
in slots 0..width-1 with holes the mask hides (kv/static_ragged.py), so a forward reads the view
[:rows, :, :, :width] and no gather. vLLM and SGLang preallocate their KV memory the same way,
in pages; fixed slots per row are the simpler shape for a batch of at most a few dozen rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from inference.engine.errors import ConfigError


@dataclass(frozen=True)
class PoolShape:
    """The geometry of a model's KV pool."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: PreTrainedModel) -> PoolShape:
        config = model.config.get_text_config(decoder=True)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, model.dtype)

    def bytes_per_slot(self) -> int:
        """Keys and values of one token of one row, every layer."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * element


def pool_rows_within(shape: PoolShape, capacity: int, budget_bytes: int, wanted_rows: int) -> int:
    """How many rows of `capacity` slots fit in `budget_bytes` (at most `wanted_rows`); a budget
    that holds less than one row is an operator's mistake, said in one line."""
    per_row = shape.bytes_per_slot() * capacity
    rows = min(wanted_rows, budget_bytes // per_row)
    if rows < 1:
        raise ConfigError(f"KV cache budget: {budget_bytes / 2**20:.0f} MiB holds no row of {capacity} slots "
                          f"({per_row / 2**20:.1f} MiB a row); raise SPECOPS_KV_CACHE_MB")
    return int(rows)


class KVPool:
    """[rows, layers, kv_heads, capacity, head_dim] keys and values (see the module docstring)."""

    def __init__(self, shape: PoolShape, rows: int, capacity: int, device: torch.device | str) -> None:
        size = (rows, shape.layers, shape.kv_heads, capacity, shape.head_dim)
        # zeros, not empty: a hole's slot is masked, but its value still enters a product (times 0)
        self.keys = torch.zeros(size, dtype=shape.dtype, device=device)
        self.values = torch.zeros(size, dtype=shape.dtype, device=device)
        self.shape = shape

    @property
    def rows(self) -> int:
        return self.keys.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def view(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, layers, kv_heads, width, head_dim] keys and values: what a forward reads."""
        return self.keys[:rows, :, :, :width], self.values[:rows, :, :, :width]

    def write(self, rows: int, start: int,
              # [>= rows, layers, kv_heads, >= count, head_dim]
              keys: torch.Tensor, values: torch.Tensor, count: int) -> None:
        """Put a forward's new keys and values (the first `count` of each row's) at slots start.."""
        self.keys[:rows, :, :, start:start + count] = keys[:rows, :, :, :count]
        self.values[:rows, :, :, start:start + count] = values[:rows, :, :, :count]

    def keep_rows(self, rows: list[int], width: int | None = None) -> None:
        """Rows `rows` (in that order) become rows 0..len-1; the rest are free. Only the first
        `width` slots (all when None) are moved: the rest hold nothing a row reads, and a pool is
        most of a device's memory, so a copy of all of it would cost more than the step."""
        if rows == list(range(len(rows))):
            return
        width = self.capacity if width is None else width
        if width <= 0:
            return
        if all(first < second for first, second in zip(rows, rows[1:])):
            # in order (rows leaving the batch): each kept row moves down, onto a row already read
            for destination, source in enumerate(rows):
                if destination != source:
                    self.keys[destination, :, :, :width] = self.keys[source, :, :, :width]
                    self.values[destination, :, :, :width] = self.values[source, :, :, :width]
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.keys.device)
        self.keys[:len(rows), :, :, :width] = self.keys[:, :, :, :width].index_select(0, index)
        self.values[:len(rows), :, :, :width] = self.values[:, :, :, :width].index_select(0, index)

    def gather_row(self, row: int,
                   # [width] the row's slots in sequence order
                   slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[layers, kv_heads, len(slots), head_dim] copies of the row's keys and values at `slots`."""
        slots = slots.to(self.keys.device)
        return self.keys[row].index_select(2, slots), self.values[row].index_select(2, slots)

    def put_row(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write [layers, kv_heads, n, head_dim] at the front of `row`."""
        count = keys.shape[2]
        self.keys[row, :, :, :count] = keys.to(self.keys.device)
        self.values[row, :, :, :count] = values.to(self.values.device)

    def compact(self, rows: int,
                # [rows, width] the source slot of each destination slot (its sequence order)
                index: torch.Tensor) -> None:
        """Move every row's tokens to the front: slot j of row r takes slot index[r, j]."""
        width = index.shape[1]
        index = index.to(self.keys.device)
        for tensor in (self.keys, self.values):
            gather = index[:, None, None, :, None].expand(-1, tensor.shape[1], tensor.shape[2], -1, tensor.shape[4])
            tensor[:rows, :, :, :width] = tensor[:rows].gather(3, gather)
