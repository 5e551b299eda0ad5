"""Attention one query at a time over exactly the keys it sees, for models that round their rows.

SDPA on a CPU computes a query's output in products whose blocking depends on the whole call: the
same query over the same visible keys gets other low bits when it shares the call with other
queries, or when masked keys pad its row (measured, torch 2.13 on this project's AMD EPYC VMs:
layer 0's attention output of a prompt's token differs by an ulp between the prompt's forward and
a one-token forward). A float model shrugs that off, but a model that rounds each row's
activations (an int8 target: `Int8Linear`'s per-token quantisation) sometimes turns that ulp into
a whole int8 step, which grows layer by layer into other logits, so its speculative verify
(1 + k queries on the cache) picked another token than its own one-token-at-a-time greedy.

Such a model is marked (`mark_row_exact`, done by `quantize_int8` for per-token targets) and the
lean forward runs its attention one SDPA call per query, over its visible keys only: a slice of
the cache when they are contiguous (measured: a slice's offset and strides do not change the
bits), else gathered in slot order. That is the call a one-token forward makes, so every row of a
prefill, a verify or a batch equals it bit for bit. It costs a call per query and layer (a
prefill's rows too): worth it only where the rounding would amplify the ulp. Only the lean
forward (the Llama family, models/modeling.py) honours the mark: any other model runs
transformers' own attention, whose rows keep the same dependence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ROW_EXACT_ATTRIBUTE = "_specops_row_exact_attention"

# What one query attends to: a contiguous range of cache slots, their indices, or nothing (padding).
KeySpan = slice | torch.Tensor | None


def mark_row_exact(model: torch.nn.Module) -> torch.nn.Module:
    """Make the lean forward run `model`'s attention query by query (see the module docstring)."""
    setattr(model, _ROW_EXACT_ATTRIBUTE, True)
    return model


def is_row_exact(model: torch.nn.Module) -> bool:
    return bool(getattr(model, _ROW_EXACT_ATTRIBUTE, False))


def visible_keys(
    # [rows or 1, 1, new_tokens, past + new_tokens] additive (0 = may attend), or None: causal
    attention_mask: torch.Tensor | None,
    rows: int,
    new_tokens: int,
    past: int,
) -> list[list[KeySpan]]:
    """For each row and new token, the cache slots it attends to. Once per forward, not per layer."""
    if attention_mask is None:
        causal = [slice(0, past + i + 1) for i in range(new_tokens)]
        return [causal for _ in range(rows)]
    # [rows, new_tokens, slots]
    allowed = (attention_mask[:, 0] == 0).expand(rows, new_tokens, -1)
    slots = torch.arange(allowed.shape[-1], device=allowed.device)
    counts = allowed.sum(-1).tolist()
    firsts = torch.where(allowed, slots, allowed.shape[-1]).amin(-1).tolist()
    lasts = torch.where(allowed, slots, -1).amax(-1).tolist()
    spans: list[list[KeySpan]] = []
    for row in range(rows):
        spans.append([])
        for token in range(new_tokens):
            count, first, last = counts[row][token], firsts[row][token], lasts[row][token]
            if count == 0:
                spans[row].append(None)
            elif last - first + 1 == count:
                spans[row].append(slice(first, last + 1))
            else:
                spans[row].append(allowed[row, token].nonzero()[:, 0])
    return spans


def attention_by_row(
    # [rows, heads, new_tokens, head_dim]
    query: torch.Tensor,
    # [rows, kv_heads, slots, head_dim]
    key: torch.Tensor,
    # [rows, kv_heads, slots, head_dim]
    value: torch.Tensor,
    spans: list[list[KeySpan]],
    scale: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """SDPA one query at a time over its own keys; [rows, heads, new_tokens, head_dim].

    A query that sees nothing (a padding slot) gets zeros: nothing reads its output."""
    output = query.new_zeros(query.shape)
    for row, row_spans in enumerate(spans):
        for token, span in enumerate(row_spans):
            if span is None:
                continue
            if isinstance(span, slice):
                keys, values = key[row:row + 1, :, span], value[row:row + 1, :, span]
            else:
                keys, values = key[row:row + 1].index_select(2, span), value[row:row + 1].index_select(2, span)
            output[row:row + 1, :, token:token + 1] = F.scaled_dot_product_attention(
                query[row:row + 1, :, token:token + 1], keys, values, scale=scale, enable_gqa=enable_gqa)
    return output
