"""Draft every DSpark row of a batch in one backbone forward.

Each row keeps its own context cache (its committed positions' projected features, drafter.py);
here the rows' caches are padded to the longest and stacked, a mask hides each row's padding,
and the blocks of all rows go through the backbone at once — one forward per step for the whole
batch instead of one per row.

A padded forward may round differently from a row's own, so its draft tokens may differ in the
last bit of a logit. Greedy output does not depend on the draft (verification keeps the target's
argmax), but a seeded sampled row's does: such rows draft alone (`drafts_alone`), so their tokens
never depend on their companions, as everywhere else in the batched engine.

With a `BlockRunner` whose package is loaded (compiled.py), the greedy rows draft in one call of
the compiled block instead, and the sampled rows eagerly beside them.
"""

from __future__ import annotations

import torch

from inference.engine.decode.draft_tree import DraftTree
from inference.engine.drafters.base import DraftRequest
from inference.engine.drafters.dspark.compiled import BlockRunner
from inference.engine.drafters.dspark.drafter import DSparkDrafter, block_tree, draft_block, survival_estimates
from inference.engine.drafters.dspark.modeling import DSparkModel
from inference.engine.runner.model_runner import PATH_EAGER


def drafts_alone(request: DraftRequest, seeded: bool) -> bool:
    """A seeded sampled row drafts in a forward of its own (see the module docstring)."""
    return request.sampling is not None and seeded


@torch.inference_mode()
def propose_blocks(drafters: list[DSparkDrafter], contexts: list[list[int]], requests: list[DraftRequest],
                   runner: BlockRunner | None = None) -> list[DraftTree]:
    """The rows' draft trees; rows asking for depth 0 (or with no features yet) get empty trees.
    With a `runner` whose package is loaded, the greedy rows draft in its compiled block."""
    trees = [DraftTree.empty()] * len(drafters)
    live = [index for index, (drafter, request) in enumerate(zip(drafters, requests))
            if request.max_depth > 0 and drafter.context.length > 0]
    if not live:
        return trees
    model = drafters[live[0]].model
    if any(drafters[index].model is not model for index in live):
        raise ValueError("propose_blocks: every row must run the same DSpark model")
    for index in live:
        if drafters[index].context.length != len(contexts[index]) - 1:
            raise RuntimeError("dspark: a row's features do not cover its context before the anchor")
    compiled = [index for index in live if requests[index].sampling is None] if runner is not None and runner.ready else []
    if compiled:
        _draft_compiled(runner, drafters, contexts, requests, compiled, trees)
    eager = [index for index in live if index not in compiled]
    if runner is not None and eager:
        runner.stats.forwards[PATH_EAGER] += 1
    if len(eager) == 1:
        index = eager[0]
        trees[index] = drafters[index].propose(contexts[index], requests[index])
    elif eager:
        hidden = _block_hidden(model, [drafters[index] for index in eager], [contexts[index] for index in eager])
        for row, index in enumerate(eager):
            drafter, request = drafters[index], requests[index]
            depth = min(request.max_depth, model.block_size)
            trees[index] = draft_block(model, hidden[row], contexts[index][-1], depth, drafter.vocab_width,
                                       request, drafter.config.confidence_threshold)
    return trees


def _context(model: DSparkModel, drafters: list[DSparkDrafter]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per layer the rows' context keys, then values, zero-padded to the longest; the rows' lengths."""
    lengths = [drafter.context.length for drafter in drafters]
    longest = max(lengths)
    context = []
    for layer in range(len(model.layers)):
        context.append(_stack([drafter.context.keys[layer] for drafter in drafters], longest))
        context.append(_stack([drafter.context.values[layer] for drafter in drafters], longest))
    return context, torch.tensor(lengths, device=model.fc.weight.device)


def _block_hidden(model: DSparkModel, drafters: list[DSparkDrafter], contexts: list[list[int]]) -> torch.Tensor:
    """The backbone's hidden states of the rows' blocks, eagerly, in one padded forward."""
    device = model.fc.weight.device
    context, lengths = _context(model, drafters)
    keys, values = context[0::2], context[1::2]
    longest, block, dtype = keys[0].shape[2], model.block_size, keys[0].dtype
    # [rows, 1, block, longest + block]: a row's padded context slots are hidden
    mask = torch.zeros(len(drafters), 1, block, longest + block, dtype=dtype, device=device)
    for row, length in enumerate(lengths.tolist()):
        mask[row, :, :, length:longest] = torch.finfo(dtype).min
    anchors = torch.tensor([context[-1] for context in contexts], device=device)
    starts = torch.tensor([len(context) - 1 for context in contexts], device=device)
    return model.block_hidden(model.block_ids(anchors), starts, keys, values, mask)


def _draft_compiled(runner: BlockRunner, drafters: list[DSparkDrafter], contexts: list[list[int]],
                    requests: list[DraftRequest], indices: list[int], trees: list[DraftTree]) -> None:
    """Greedy rows `indices` drafted in the compiled block; one read brings their blocks back."""
    model = runner.model
    device = model.fc.weight.device
    context, lengths = _context(model, [drafters[index] for index in indices])
    anchors = torch.tensor([contexts[index][-1] for index in indices], device=device)
    starts = torch.tensor([len(contexts[index]) - 1 for index in indices], device=device)
    tokens, log_probs, confidence = runner.draft(anchors, starts, lengths, context)
    tokens, log_probs, confidence = tokens.tolist(), log_probs.tolist(), confidence.tolist()
    for row, index in enumerate(indices):
        depth = min(requests[index].max_depth, model.block_size)
        survival = survival_estimates(confidence[row] if model.confidence_head is not None else None,
                                      model.calibration, depth)
        trees[index] = block_tree(tokens[row][:depth], log_probs[row][:depth], [], survival,
                                  drafters[index].config.confidence_threshold)


def _stack(tensors: list[torch.Tensor], longest: int) -> torch.Tensor:
    """[1, heads, length, dim] each -> [rows, heads, longest, dim], zero-padded at the end."""
    padded = []
    for tensor in tensors:
        missing = longest - tensor.shape[2]
        if missing:
            tensor = torch.nn.functional.pad(tensor, (0, 0, 0, missing))
        padded.append(tensor)
    return torch.cat(padded, dim=0)
