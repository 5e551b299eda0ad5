"""Packed linear layers: a ragged forward's padding costs nothing in the linear layers, and the
outputs stay the target's (greedy token for token; logits to within GEMM rounding)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from inference.engine.batch.engine import BatchedSpeculativeEngine
from inference.engine.batch.policy import SpeculationPolicy
from inference.engine.decode.target_only import generate_plain
from inference.engine.kv.ragged import RaggedCache, RowInput

from .conftest import VOCAB_SIZE, noisy_copy, target_model
from .test_batch import PROPERTY_SETTINGS, _decode, batches

STEPS = [(7, 3, 0, 5), (1, 1, 1, 0), (4, 2, 4, 1), (1, 0, 1, 1), (5, 1, 1, 1)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_packed_logits_are_the_padded_ones_to_within_rounding(arch, dtype, tolerance):
    model = target_model(arch, dtype)
    caches = [RaggedCache(model, packed=False), RaggedCache(model, packed=True)]
    for cache in caches:
        for _ in range(4):
            cache.add_row()
    generator = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for widths in STEPS:
            inputs = []
            for row, count in enumerate(widths):
                start = len(caches[0].row_slots(row))
                tokens = torch.randint(2, VOCAB_SIZE, (count,), generator=generator).tolist()
                inputs.append(RowInput(tokens, list(range(start, start + count))))
            padded, packed = (cache.forward(inputs) for cache in caches)
            for row, count in enumerate(widths):
                if count:
                    torch.testing.assert_close(packed[row], padded[row], rtol=tolerance, atol=tolerance)
                    assert torch.equal(packed[row].argmax(-1), padded[row].argmax(-1))


def test_packing_runs_the_linear_layers_on_the_real_tokens_only():
    model = target_model("llama", torch.float32)
    rows_seen = []
    hook = model.model.layers[0].mlp.gate_proj.register_forward_hook(
        lambda module, args, output: rows_seen.append(args[0].numel() // args[0].shape[-1]))
    try:
        for packed in (False, True):
            cache = RaggedCache(model, packed=packed)
            for _ in range(3):
                cache.add_row()
            with torch.inference_mode():
                cache.forward([RowInput([5, 6, 7, 8, 9], list(range(5))), RowInput([3], [0]), RowInput([4], [0])])
    finally:
        hook.remove()
    assert rows_seen == [15, 7]  # 3 rows padded to 5 tokens, then the 7 real tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@PROPERTY_SETTINGS
@given(batch=batches(), max_rows=st.integers(1, 5), prefill=st.sampled_from(["shared", "separate"]))
def test_greedy_rows_of_a_packed_engine_equal_the_targets_own_greedy_output(arch, batch, max_rows, prefill):
    requests, arrivals = batch
    engine = BatchedSpeculativeEngine(target_model(arch), noisy_copy(arch), decode=_decode, max_rows=max_rows,
                                      prefill_chunk=3, prefill=prefill, pack_linear=True,
                                      policy=SpeculationPolicy())
    results = engine.run(requests, arrivals)
    for request in requests:
        expected = generate_plain(target_model(arch), request.prompt_ids, request.config, decode=_decode)
        assert results[request.request_id].token_ids == expected.token_ids, (request.request_id, request.drafter)
