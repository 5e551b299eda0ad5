"""The chain drafter (batch/chain_drafting.py) on its own: no engine, a draft cache and rows in.

`ChainDrafter` is handed the draft's ragged cache, its rows, each row's depth, the confidence
scheduler's `extend_chains` and a forward observer, and returns the rows' chains. Here:
- a greedy row's chain is the one the draft model drafts for that row alone, whoever shares the
  forwards, and again after the row's context went on (the cache keeps the drafted tokens the
  context accepted and catches up from there);
- the device step's chains (`draft_on_device`) are the host path's: the same tokens, drawn from
  the same generators, with the same scores;
- a chain `extend_chains` closes stops where it was closed while the others go on, and every
  shared forward is told to the observer (rows fed, widest row).
"""

from __future__ import annotations

import pytest
import torch

from inference.engine import GenerationConfig
from inference.engine.batch.chain_drafting import ChainDrafter
from inference.engine.batch.rows import BatchRequest, BatchRow
from inference.engine.decode.stopping import StopCondition
from inference.engine.kv.ragged import RaggedCache

from .conftest import VOCAB_SIZE, draft_model

PROMPTS = [[1, 5, 9, 2], [7, 3], [4, 4, 8, 1, 6, 2, 3], [11, 12, 13]]
DEPTHS = [3, 1, 4, 2]


def _row(index: int, prompt: list[int], config: GenerationConfig) -> BatchRow:
    request = BatchRequest(index, prompt, config, drafter="draft_model")
    row = BatchRow(request, "draft_model", 16, StopCondition(config, 16, None), torch.device("cpu"))
    row.prefilled = row.prompt_length  # decoding: only the draft's cache is the drafter's
    return row


def _rows(config: GenerationConfig) -> list[BatchRow]:
    return [_row(index, list(prompt), config) for index, prompt in enumerate(PROMPTS)]


def _keep_all(rows, indices):
    return indices


def _greedy_alone(context: list[int], depth: int) -> list[int]:
    """The draft's greedy chain for one context, each position a full forward."""
    model, ids = draft_model("llama"), list(context)
    with torch.no_grad():
        for _ in range(depth):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(context):]


def _host(rows, depths, extend=_keep_all, forwards=None):
    drafter = ChainDrafter(VOCAB_SIZE, VOCAB_SIZE)
    cache = RaggedCache(draft_model("llama"))
    for row in rows:
        cache.add_row()
    log = forwards if forwards is not None else []
    with torch.inference_mode():
        trees = drafter.draft(cache, rows, {id(row): depth for row, depth in zip(rows, depths)}, 64,
                              extend, lambda *forward: log.append(forward))
    return drafter, cache, trees


def test_a_greedy_rows_chain_is_the_one_it_drafts_alone_and_again_after_its_context_goes_on():
    rows = _rows(GenerationConfig(max_new_tokens=16))
    drafter, cache, trees = _host(rows, DEPTHS)
    for row, depth in zip(rows, DEPTHS):
        assert trees[id(row)].token_ids == _greedy_alone(row.context, depth)
    # each row accepts its first drafted token and adds one of its own: the cache keeps the one
    for row in rows:
        row.context += [trees[id(row)].token_ids[0], 17]
    with torch.inference_mode():
        again = drafter.draft(cache, rows, {id(row): 2 for row in rows}, 64, _keep_all, lambda *forward: None)
    for row in rows:
        assert again[id(row)].token_ids == _greedy_alone(row.context, 2)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_device_steps_chains_are_the_host_paths(temperature):
    config = GenerationConfig(max_new_tokens=16, temperature=temperature, top_k=20, seed=5)
    host_rows, device_rows = _rows(config), _rows(config)
    _, _, trees = _host(host_rows, DEPTHS)
    drafter = ChainDrafter(VOCAB_SIZE, VOCAB_SIZE)
    cache = RaggedCache(draft_model("llama"))
    for row in device_rows:
        cache.add_row()
    with torch.inference_mode():
        chains = drafter.draft_on_device(cache, device_rows, {id(row): d for row, d in zip(device_rows, DEPTHS)},
                                         torch.device("cpu"), lambda *forward: None)
    for host, device in zip(host_rows, device_rows):
        tree, chain = trees[id(host)], chains[id(device)]
        assert tree.token_ids == chain.tokens.tolist()
        assert torch.allclose(torch.tensor(tree.log_probs, dtype=torch.float64),
                              chain.log_probs.to(torch.float64))
        assert (chain.draft_probs is None) == (temperature == 0.0)


def test_a_closed_chain_stops_while_the_others_go_on_and_every_forward_is_observed():
    alone = _rows(GenerationConfig(max_new_tokens=16))
    _, _, trees = _host(alone, DEPTHS)
    full = [trees[id(row)].token_ids for row in alone]  # every chain to its depth
    rows = _rows(GenerationConfig(max_new_tokens=16))
    closed = rows[2]  # deepest: asked for 4, closed after its first token

    def extend(chain_rows, indices):
        return [index for row, index in zip(chain_rows, indices) if row is not closed]

    forwards: list[tuple[int, int, float]] = []
    _, _, trees = _host(rows, DEPTHS, extend, forwards)
    assert trees[id(closed)].token_ids == full[2][:1]
    assert closed.draft_extra == []  # nothing past its context was fed
    for index, row in enumerate(rows):
        if row is not closed:
            assert trees[id(row)].token_ids == full[index]
    # the catch-up forward feeds every row its prompt; each later one the chains still open
    assert [(fed, widest) for fed, widest, _ in forwards] == [(4, 7), (2, 1), (1, 1)]
