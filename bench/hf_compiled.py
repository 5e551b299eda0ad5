"""The outside reference for a compiled decode: transformers' own `StaticCache` + `torch.compile`.

What a user who picks transformers instead of SpecOps would write for fast batch-1 greedy
decoding on a CPU: the model's own forward over a `StaticCache`, the one-token step compiled
whole (`fullgraph=True`, inductor's C++ wrapper), a hand-written greedy loop, the prompt
prefilled eagerly. `bench/serving.py` times it beside the engine's compiled plain decoding
(`ours_plain_c1_over_hf_compiled`).
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel, StaticCache


class HFCompiledGreedy:
    """Greedy decoding of one prompt at a time over a StaticCache, the decode step compiled once."""

    def __init__(self, model: PreTrainedModel, max_length: int) -> None:
        import torch._inductor.config as inductor_config

        inductor_config.cpp_wrapper = True
        self.model = model
        self.max_length = max_length
        self.cache = StaticCache(config=model.config, max_cache_len=max_length)
        self._step = torch.compile(self._forward, fullgraph=True)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=self.cache,
                          use_cache=True).logits[:, -1]

    def generate(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        """The greedy tokens and the seconds per decode step (the prefill excluded)."""
        device = self.model.device
        with torch.inference_mode():
            self.cache.reset()
            ids = torch.tensor([prompt], device=device)
            logits = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True).logits[:, -1]
            token = logits.argmax(dim=-1, keepdim=True)
            tokens = [int(token)]
            started = time.perf_counter()
            for position in range(len(prompt), len(prompt) + max_new_tokens - 1):
                logits = self._step(token, torch.tensor([[position]], device=device))
                token = logits.argmax(dim=-1, keepdim=True)
                tokens.append(int(token))
            seconds = (time.perf_counter() - started) / max(max_new_tokens - 1, 1)
        return tokens, seconds
