"""The one place that calls a transformers model: forward with a cache, context length, vocab.

Uses the transformers 5.x names (`cache=`, `logits_to_keep=`); a custom 4D additive mask and
explicit position ids are passed only for trees, chains use the model's own causal mask.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from inference.engine.errors import UnsupportedModelError

# Config attributes that hold the longest sequence a model was built for, most specific first.
_CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length",
                       "seq_length")


def context_length(model: PreTrainedModel) -> int:
    """The longest sequence (prompt + generated) the model's positions cover."""
    config = model.config.get_text_config(decoder=True)
    for name in _CONTEXT_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise UnsupportedModelError(
        f"{type(model).__name__}: config names no context length ({', '.join(_CONTEXT_ATTRIBUTES)})")


def logits_width(model: PreTrainedModel) -> int:
    """Columns of the model's logits (the LM head may be padded past the tokenizer)."""
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)


def forward_logits(
    model: PreTrainedModel,
    token_ids: list[int],
    cache: DynamicCache,
    keep: int,
    # [1, 1, new_tokens, cached + new_tokens] additive mask, or None for plain causal
    attention_mask: torch.Tensor | None = None,
    # [1, new_tokens], or None for positions that follow the cache
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run `token_ids` through the model on top of `cache`; return the last `keep` logits rows.

    Returns [keep, vocab_size]. The cache grows by len(token_ids).
    """
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
    output = model(input_ids=input_ids, cache=cache, attention_mask=attention_mask,
                   position_ids=position_ids, use_cache=True, logits_to_keep=keep)
    return output.logits[0]


def align_vocab(
    # [num_rows, draft_vocab]
    logits: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Make draft logits as wide as the target's: cut padding columns or pad with -inf."""
    current = logits.shape[-1]
    if current == width:
        return logits
    if current > width:
        return logits[..., :width]
    pad = logits.new_full((*logits.shape[:-1], width - current), float("-inf"))
    return torch.cat((logits, pad), dim=-1)
