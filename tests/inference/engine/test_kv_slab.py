"""SlabLayer: appends in place yet holds, after every operation, what transformers' DynamicLayer holds."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer

from inference.engine.kv.slab import SlabLayer

ROWS, HEADS, DIM = 3, 2, 4

# one operation on a cache layer: append n tokens, crop to n, keep rows, or reassign (compaction)
OPERATION = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 40)),
    st.tuples(st.just("crop"), st.integers(0, 60)),
    st.tuples(st.just("keep_rows"), st.just(None)),
    st.tuples(st.just("reassign"), st.just(None)),
)


def _apply(layer, operation, argument, generator, rows):
    if operation == "append":
        keys = torch.randn(rows, HEADS, argument, DIM, generator=generator)
        values = torch.randn(rows, HEADS, argument, DIM, generator=generator)
        returned = layer.update(keys, values)
        return returned
    if not layer.is_initialized or layer.keys.dim() != 4:
        return None
    if operation == "crop":
        layer.keys = layer.keys[:, :, :argument]
        layer.values = layer.values[:, :, :argument]
    elif operation == "keep_rows":
        index = torch.arange(rows - 1, -1, -1)
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)
    else:
        layer.keys = layer.keys.flip(2).contiguous()
        layer.values = layer.values.flip(2).contiguous()
    return None


@settings(max_examples=60, deadline=None)
@given(operations=st.lists(OPERATION, min_size=1, max_size=25), seed=st.integers(0, 2**16))
def test_slab_layer_holds_what_a_dynamic_layer_holds(operations, seed):
    slab, dynamic = SlabLayer(), DynamicLayer()
    slab_generator = torch.Generator().manual_seed(seed)
    dynamic_generator = torch.Generator().manual_seed(seed)
    for operation, argument in operations:
        returned_slab = _apply(slab, operation, argument, slab_generator, ROWS)
        returned_dynamic = _apply(dynamic, operation, argument, dynamic_generator, ROWS)
        if returned_dynamic is not None:
            assert torch.equal(returned_slab[0], returned_dynamic[0])
            assert torch.equal(returned_slab[1], returned_dynamic[1])
        assert slab.get_seq_length() == dynamic.get_seq_length()
        if dynamic.is_initialized and dynamic.keys.dim() == 4:
            assert torch.equal(slab.keys, dynamic.keys)
            assert torch.equal(slab.values, dynamic.values)


def test_appends_write_in_place_until_the_buffer_is_full():
    layer = SlabLayer()
    layer.update(torch.ones(1, HEADS, 10, DIM), torch.ones(1, HEADS, 10, DIM))
    first = layer.keys.data_ptr()
    capacity = layer._buffers["keys"].shape[2]
    assert capacity > 10  # room to grow
    appended = 10
    while appended + 1 <= capacity:
        layer.update(torch.full((1, HEADS, 1, DIM), 2.0), torch.full((1, HEADS, 1, DIM), 2.0))
        appended += 1
        assert layer.keys.data_ptr() == first  # no copy
    layer.update(torch.full((1, HEADS, 1, DIM), 3.0), torch.full((1, HEADS, 1, DIM), 3.0))
    assert layer.keys.data_ptr() != first  # grown: one copy
    assert layer.get_seq_length() == capacity + 1
    assert layer.keys[0, 0, -1, 0].item() == 3.0 and layer.keys[0, 0, 0, 0].item() == 1.0


def test_crop_is_a_view_and_the_next_append_overwrites_the_dropped_slots():
    layer = SlabLayer()
    layer.update(torch.arange(8.0).view(1, 1, 8, 1), torch.arange(8.0).view(1, 1, 8, 1))
    pointer = layer.keys.data_ptr()
    layer.crop(-3)
    assert layer.get_seq_length() == 5 and layer.keys.data_ptr() == pointer
    keys, _ = layer.update(torch.full((1, 1, 2, 1), -1.0), torch.full((1, 1, 2, 1), -1.0))
    assert keys.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, -1.0, -1.0]
