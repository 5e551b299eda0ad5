"""The step-cost table the speculation policy starts from: a few warm forwards timed when the engine is built.

The policy (policy.py) picks a draft depth from its models of forward time. Fitted only from the
steps the batch ran, a fresh engine knew nothing of the draft's cost (never drafted, so never
measured) and assumed a draft forward cost a millisecond whatever the models: against a target
forward of about that, every depth looked like a loss, the first step chose 0, and the policy
sat at "don't draft" (a fresh `make run`: 95 of 96 steps of the first greedy generation without
a draft). DSpark's scheduler works from a cost table profiled at start and refreshed from
measured steps; this is that table: target forwards of 1 and a few rows at 1 token (a decode
step) and `max_depth + 1` (the deepest verify), and draft forwards at 1 and 2 tokens (a chain's
steps), each shape timed after an untimed warm-up (kernel selection, allocation, a cold cache
are one-time costs a step does not pay). The measurements go into the policy's cost models like
any step's, so the steps the engine runs refine them and, in time, replace them.

The forwards run in caches of their own over a short context of filler tokens: nothing of the
batch is touched, and what a generation outputs does not depend on them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from inference.engine.batch.policy import ForwardCostModel, SpeculationPolicy
from inference.engine.kv.ragged import RaggedCache, RowInput

# Context each profiled row holds before the timed forwards: attention over a short prompt, as
# a step of a real row has, rather than over nothing.
PROFILE_CONTEXT = 16
# Timed forwards per shape (the cost model keeps each shape's median).
PROFILE_REPEATS = 3
# Row counts profiled: a lone row (the first request of a fresh worker) and a small batch, so
# the fit has a per-row term from the start; larger batches are measured as they run.
PROFILE_ROWS = (1, 4)


def profile_step_costs(policy: SpeculationPolicy, target: PreTrainedModel,
                       draft: PreTrainedModel | None, max_rows: int, context_length: int,
                       draft_context_length: int, vocab: int,
                       new_cache: Callable[[PreTrainedModel], RaggedCache] = RaggedCache) -> None:
    """Time the forwards of a decode step and of the deepest verify (and the draft's chain
    forwards), and record them in `policy`'s cost models (see the module docstring)."""
    rows = sorted({min(count, max_rows) for count in PROFILE_ROWS})
    widths = sorted({1, policy.max_depth + 1})
    with torch.inference_mode():
        _profile(policy.target_costs, new_cache(target), rows, widths, context_length, vocab)
        if draft is not None:
            _profile(policy.draft_costs, new_cache(draft), rows, [1, 2], draft_context_length, vocab)


def _profile(costs: ForwardCostModel, cache: RaggedCache, rows: list[int], widths: list[int],
             context_length: int, vocab: int) -> None:
    """Time the shapes in `cache` (an empty batch cache of the model: its rows are left empty)."""
    widths = [width for width in widths if width < context_length]
    if not widths or vocab <= 0:
        return
    prefix = max(1, min(PROFILE_CONTEXT, context_length - max(widths)))
    # filler ids away from the special tokens low in most vocabularies
    filler = [(3 + index * 7) % vocab for index in range(prefix + max(widths))]
    model = cache.model
    for count in rows:
        cache.keep_rows([])
        for _ in range(count):
            cache.add_row()
        cache.forward([RowInput(filler[:prefix], list(range(prefix)))] * count, logits="none")
        for width in widths:
            tokens = RowInput(filler[prefix:prefix + width], list(range(prefix, prefix + width)))
            seconds = []
            for repeat in range(PROFILE_REPEATS + 1):
                started = time.perf_counter()
                cache.forward([tokens] * count)
                _synchronize(model)
                if repeat:  # the first one is the warm-up
                    seconds.append(time.perf_counter() - started)
                for row in range(count):
                    cache.truncate_row(row, prefix)
            for measured in seconds:  # the fit keeps each shape's median: a stray slow one is outvoted
                costs.observe(count, width, measured)


def _synchronize(model: PreTrainedModel) -> None:
    """Wait for an accelerator's queued work, so a forward's time is its own."""
    device = model.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
