"""Draft every DSpark row of a batch in one backbone forward.

Each row keeps its own context cache (its committed positions' projected features, drafter.py);
here the rows' caches are padded to the longest and stacked, a mask hides each row's padding,
and the blocks of all rows go through the backbone at once — one forward per step for the whole
batch instead of one per row.

A padded forward may round differently from a row's own, so its draft tokens may differ in the
last bit of a logit. Greedy output does not depend on the draft (verification keeps the target's
argmax), but a seeded sampled row's does: such rows draft alone (`drafts_alone`), so their tokens
never depend on their companions, as everywhere else in the batched engine.
"""

from __future__ import annotations

import torch

from inference.engine.decode.draft_tree import DraftTree
from inference.engine.drafters.base import DraftRequest
from inference.engine.drafters.dspark.drafter import DSparkDrafter, draft_block


def drafts_alone(request: DraftRequest, seeded: bool) -> bool:
    """A seeded sampled row drafts in a forward of its own (see the module docstring)."""
    return request.sampling is not None and seeded


@torch.inference_mode()
def propose_blocks(drafters: list[DSparkDrafter], contexts: list[list[int]],
                   requests: list[DraftRequest]) -> list[DraftTree]:
    """The rows' draft trees; rows asking for depth 0 (or with no features yet) get empty trees."""
    trees = [DraftTree.empty()] * len(drafters)
    live = [index for index, (drafter, request) in enumerate(zip(drafters, requests))
            if request.max_depth > 0 and drafter.context.length > 0]
    if not live:
        return trees
    if len(live) == 1:
        index = live[0]
        trees[index] = drafters[index].propose(contexts[index], requests[index])
        return trees
    model = drafters[live[0]].model
    if any(drafters[index].model is not model for index in live):
        raise ValueError("propose_blocks: every row must run the same DSpark model")
    for index in live:
        if drafters[index].context.length != len(contexts[index]) - 1:
            raise RuntimeError("dspark: a row's features do not cover its context before the anchor")
    device = model.fc.weight.device
    lengths = [drafters[index].context.length for index in live]
    longest, block = max(lengths), model.block_size
    keys, values = [], []
    for layer in range(len(model.layers)):
        keys.append(_stack([drafters[index].context.keys[layer] for index in live], longest))
        values.append(_stack([drafters[index].context.values[layer] for index in live], longest))
    dtype = keys[0].dtype
    # [rows, 1, block, longest + block]: a row's padded context slots are hidden
    mask = torch.zeros(len(live), 1, block, longest + block, dtype=dtype, device=device)
    for row, length in enumerate(lengths):
        mask[row, :, :, length:longest] = torch.finfo(dtype).min
    anchors = torch.tensor([contexts[index][-1] for index in live], device=device)
    starts = torch.tensor([len(contexts[index]) - 1 for index in live], device=device)
    hidden = model.block_hidden(model.block_ids(anchors), starts, keys, values, mask)
    for row, index in enumerate(live):
        drafter, request = drafters[index], requests[index]
        depth = min(request.max_depth, block)
        trees[index] = draft_block(model, hidden[row], contexts[index][-1], depth, drafter.vocab_width,
                                   request, drafter.config.confidence_threshold)
    return trees


def _stack(tensors: list[torch.Tensor], longest: int) -> torch.Tensor:
    """[1, heads, length, dim] each -> [rows, heads, longest, dim], zero-padded at the end."""
    padded = []
    for tensor in tensors:
        missing = longest - tensor.shape[2]
        if missing:
            tensor = torch.nn.functional.pad(tensor, (0, 0, 0, missing))
        padded.append(tensor)
    return torch.cat(padded, dim=0)
