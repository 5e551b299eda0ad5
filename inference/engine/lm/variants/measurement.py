"""The figures a variant build records: size, forward latency, top-1 agreement with its base."""

from __future__ import annotations

import io
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def model_size_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as torch serialises them (shared tensors once, int8 packed)."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(model.state_dict(), buffer)
    return buffer.tell()


def forward_ms(model: nn.Module, tokens: int, context: int = 64, repeats: int = 20) -> float:
    """Median milliseconds of one cached forward of ``tokens`` new tokens after ``context`` tokens."""
    from transformers import DynamicCache

    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(vocab, (1, context), generator=generator)
    new = torch.randint(vocab, (1, tokens), generator=generator)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 2):
            cache = DynamicCache()
            model(input_ids=prefix, cache=cache, use_cache=True)
            started = time.perf_counter()
            model(input_ids=new, cache=cache, use_cache=True)
            times.append(time.perf_counter() - started)
    times = sorted(times[2:])
    return 1000.0 * times[len(times) // 2]


def top1_agreement(reference: nn.Module, variant: nn.Module, prompts: Iterable[list[int]]) -> tuple[float, int]:
    """Share of positions where the variant's argmax equals the reference's, teacher-forced over
    ``prompts`` (one forward each); returns (agreement, positions)."""
    agree = total = 0
    with torch.inference_mode():
        for prompt in prompts:
            if len(prompt) < 2:
                continue
            ids = torch.tensor([prompt])
            expected = reference(input_ids=ids).logits[0].argmax(-1)
            got = variant(input_ids=ids).logits[0].argmax(-1)
            agree += int((expected == got).sum())
            total += len(prompt)
    return (agree / total if total else float("nan")), total


def measure_variant(base: nn.Module, variant: nn.Module, prompts: list[list[int]]) -> dict[str, Any]:
    """The figures a build records: size, forward latency at 1 and 5 new tokens, agreement.

    Timed on one thread: on a shared CPU a second spinning thread makes small forwards erratic.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(base, variant, prompts)
    finally:
        torch.set_num_threads(threads)


def _measure(base: nn.Module, variant: nn.Module, prompts: list[list[int]]) -> dict[str, Any]:
    agreement, positions = top1_agreement(base, variant, prompts)
    return {
        "threads": 1,
        "size_bytes": model_size_bytes(variant),
        "base_size_bytes": model_size_bytes(base),
        "forward_ms_1": round(forward_ms(variant, 1), 3),
        "forward_ms_5": round(forward_ms(variant, 5), 3),
        "base_forward_ms_1": round(forward_ms(base, 1), 3),
        "base_forward_ms_5": round(forward_ms(base, 5), 3),
        "top1_agreement_with_base": round(agreement, 4),
        "agreement_positions": positions,
    }
