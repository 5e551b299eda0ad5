"""oneDNN takes a linear layer only where it gives F.linear's bits, from the row count where it is faster.

The engine's outputs must not depend on which kernel ran: these tests check that a kernel which
differs by one rounding is refused, that a faster exact one is used from where it wins, that
float64 and non-Linear modules are never touched, and that a real model's logits are the same
bit for bit with the kernels on and off (with the timing forced so that oneDNN is offered for
every shape: only exactness decides).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.engine.lm import linear_kernels as kernels_module
from inference.engine.lm.linear_kernels import (
    CANDIDATE_ROWS,
    MAX_ROWS,
    LinearKernels,
    onednn_available,
    set_linear_kernels,
)
from inference.engine.kv.ragged import RaggedCache, RowInput

from .conftest import VOCAB_SIZE, target_model

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN linear")


def _linear(in_features: int, out_features: int, bias: bool = False, dtype=torch.float32) -> torch.nn.Linear:
    torch.manual_seed(in_features * 7 + out_features)
    return torch.nn.Linear(in_features, out_features, bias=bias).to(dtype).eval()


@pytest.fixture
def onednn_always_faster(monkeypatch):
    """Timing that says the candidate wins at every row count: the exactness probe alone decides."""
    calls = iter(range(10**9))

    def fake_best_seconds(function, repeats=5, calls_per=3):
        function()
        return 2.0 if next(calls) % 2 == 0 else 1.0  # F.linear timed first, then the candidate

    monkeypatch.setattr(kernels_module, "_best_seconds", fake_best_seconds)


@needs_onednn
@pytest.mark.parametrize("shape", [(192, 192), (192, 96), (192, 512), (512, 192), (64, 128), (48, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_layer_gives_its_own_bits_whichever_kernel_runs_it(shape, bias, onednn_always_faster):
    module = _linear(*shape, bias=bias)
    kernels = LinearKernels()
    with torch.inference_mode():
        for rows in (1, 3, 15, 16, 18, 37, 50, 77, 100, 300, MAX_ROWS, MAX_ROWS + 1):
            x = torch.randn(rows, shape[0])
            assert torch.equal(kernels.linear(module, x), module(x)), rows
        # [rows, tokens, in]: a batch's 3-D hidden states keep their leading shape
        x = torch.randn(8, 5, shape[0])
        assert torch.equal(kernels.linear(module, x), module(x))


@needs_onednn
def test_a_kernel_one_rounding_off_is_refused(onednn_always_faster):
    module = _linear(192, 192)

    def off_by_one_ulp(x, weight, bias):
        out = F.linear(x, weight, bias)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    kernels = LinearKernels(candidate=off_by_one_ulp)
    with torch.inference_mode():
        x = torch.randn(64, 192)
        assert torch.equal(kernels.linear(module, x), module(x))
    choice = kernels.choice(module.weight, module.bias)
    assert choice.onednn_from is None
    assert "differs" in choice.reason


@needs_onednn
def test_an_exact_kernel_runs_from_the_row_count_where_it_is_faster(monkeypatch):
    module = _linear(192, 512)
    used: list[int] = []

    def counting(x, weight, bias):
        used.append(x.shape[0])
        return F.linear(x, weight, bias)  # exact by construction

    timings = iter(range(10**9))
    rows_timed: list[int] = []

    def fake_best_seconds(function, repeats=5, calls=3):
        count = next(timings)
        function()
        rows = CANDIDATE_ROWS[count // 2]
        rows_timed.append(rows)
        candidate_turn = count % 2 == 1
        # the candidate loses below 64 rows and wins from 64 on
        return (0.5 if rows >= 64 else 2.0) if candidate_turn else 1.0

    monkeypatch.setattr(kernels_module, "_best_seconds", fake_best_seconds)
    kernels = LinearKernels(candidate=counting)
    with torch.inference_mode():
        kernels.linear(module, torch.randn(40, 192))
        assert kernels.choice(module.weight, None).onednn_from == 64
        used.clear()
        for rows in (16, 40, 63, 64, 100, MAX_ROWS + 5):
            kernels.linear(module, torch.randn(rows, 192))
    assert used == [64, 100]
    assert sorted(set(rows_timed)) == list(CANDIDATE_ROWS)


@needs_onednn
def test_float64_layers_quantised_modules_and_small_batches_are_left_to_torch(onednn_always_faster):
    kernels = LinearKernels()
    with torch.inference_mode():
        double = _linear(64, 64, dtype=torch.float64)
        kernels.linear(double, torch.randn(100, 64, dtype=torch.float64))
        small = _linear(64, 64)
        kernels.linear(small, torch.randn(8, 64))

        class Wrapped(torch.nn.Linear):  # a subclass (quantised and hooked layers are not plain Linear)
            pass

        wrapped = Wrapped(64, 32).eval()
        kernels.linear(wrapped, torch.randn(100, 64))
    assert kernels.choices == {}


@needs_onednn
def test_a_models_logits_are_the_same_bits_with_the_kernels_on_and_off(onednn_always_faster):
    model = target_model("llama", dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)

    def logits() -> torch.Tensor:
        cache = RaggedCache(model)
        rows = [torch.randint(0, VOCAB_SIZE, (int(n),), generator=generator).tolist() for n in (30, 22, 41, 9)]
        generator.manual_seed(3)
        for _ in rows:
            cache.add_row()
        with torch.inference_mode():
            # a prefill of 4 ragged rows (4 x 41 = 164 rows of every product), then a 4 x 5 step
            first = cache.forward([RowInput(row, list(range(len(row)))) for row in rows])
            step = cache.forward([RowInput([1, 2, 3, 4, 5], list(range(len(row), len(row) + 5))) for row in rows])
        return torch.cat([torch.cat(first), torch.cat(step)])

    previous = set_linear_kernels(LinearKernels(enabled=False))
    try:
        reference = logits()
        kernels = LinearKernels()
        set_linear_kernels(kernels)
        assert torch.equal(logits(), reference)
        assert kernels.choices, "the batch's products were offered to oneDNN"
    finally:
        set_linear_kernels(previous)

