"""Text the target writes itself: what a DSpark drafter trains and is calibrated on.

The drafter must predict the target's next tokens in the contexts it meets while serving —
the target's own continuations — so its training sequences are prompts continued by the target
(greedy, or sampled at a temperature for the contexts a sampled request produces).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel


@torch.inference_mode()
def continue_sequences(target: PreTrainedModel, prompts: torch.Tensor, new_tokens: int, *,
                       temperature: float = 0.0, seed: int = 0, batch_size: int = 16,
                       on_batch: Callable[[int], None] | None = None) -> torch.Tensor:
    """Each prompt row continued by `new_tokens` of the target's (EOS does not stop it).

    prompts [rows, prompt_len] → [rows, prompt_len + new_tokens] int64 (on the CPU).
    temperature 0 is greedy; otherwise tokens are drawn from softmax(logits / temperature) by a
    generator seeded with `seed`, so the same call writes the same text. `on_batch(rows_done)`
    is told after each batch of `batch_size` rows.
    """
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
    generator = torch.Generator().manual_seed(seed)
    device = target.device
    rows: list[torch.Tensor] = []
    for start in range(0, prompts.shape[0], batch_size):
        ids = prompts[start:start + batch_size].long().to(device)
        output = target(ids, use_cache=True)
        cache, generated = output.cache, []
        for index in range(new_tokens):
            logits = output.logits[:, -1].float()  # [rows, vocab]
            if temperature > 0:
                probs = (logits / temperature).softmax(dim=-1).cpu()
                token = torch.multinomial(probs, 1, generator=generator).to(device)
            else:
                token = logits.argmax(dim=-1, keepdim=True)
            generated.append(token)
            if index + 1 < new_tokens:
                output = target(token, cache=cache, use_cache=True)
        rows.append(torch.cat([ids, *generated], dim=1).cpu())
        if on_batch is not None:
            on_batch(start + ids.shape[0])
    return torch.cat(rows) if rows else torch.empty(0, prompts.shape[1] + new_tokens, dtype=torch.long)
