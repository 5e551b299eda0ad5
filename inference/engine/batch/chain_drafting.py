"""Chain drafting for the `draft_model` rows of a batch: every row's chain in shared draft forwards.

`ChainDrafter` is a component the engine holds (`engine.chain_drafter`), with no reference back
to it. Each call takes what it drafts over: the draft's ragged cache and its rows (row i of the
cache is `rows[i]`; both held by the engine's `kv`, kv_manager.py), each row's requested depth
(`wanted`, keyed by `id(row)`) and `observe`, which is told each draft forward's rows, widest
row and seconds (the engine counts it in the step and the policy's cost model, so a later
forward's decisions see it). It reads of a row its context, what the draft cache holds of it
(`draft_synced`, `draft_extra`, which it updates) and how it draws a draft token.

Each draft forward feeds every row that still drafts one token (the first one also brings the
row's draft cache up to its context), so rows that stop early leave the others going:

- `draft` (the host path) returns each drafting row's `DraftTree` (a chain with its log
  probabilities, and the draft's distributions q where the row samples). A row stops at a
  confidence threshold, its depth, or, under confidence scheduling, a next position not worth
  its share of a forward (`extend_chains`, the confidence scheduler's, scheduling.py);
- `draft_on_device` (the one-read device step, device_step.py) returns each row's
  `DeviceChain`: every drawn token is fed to the next forward on the device, and each row
  drafts exactly its requested depth.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from inference.engine.batch.kv_manager import Cache
from inference.engine.batch.rows import BatchRow
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.sampling import warp_probs
from inference.engine.kv.ragged import RowInput
from inference.engine.lm.modeling import align_vocab, draftable_ids

# told each draft forward's (rows fed, tokens of the widest row, seconds)
ObserveForward = Callable[[int, int, float], None]
# the indices of the given rows' chains worth one more shared draft forward
ExtendChains = Callable[[list[BatchRow], list[int]], list[int]]


@dataclass
class DeviceChain:
    """A draft_model row's chain while it is on the device."""

    tokens: torch.Tensor  # [k] int64
    log_probs: torch.Tensor  # [k] the draft's log-probability of each token
    draft_probs: torch.Tensor | None  # [k, vocab] (sampled rows), None for greedy


class ChainDrafter:
    """Drafts the chains of a batch's `draft_model` rows (see the module docstring).

    vocab_width: the target's logits width, which the draft's logits are aligned to;
    draft_vocab: the draft's embedding rows (an id past them reads as a substitute).
    """

    def __init__(self, vocab_width: int, draft_vocab: int) -> None:
        self.vocab_width = vocab_width
        self.draft_vocab = draft_vocab

    def draftable(self, token_ids: list[int]) -> list[int]:
        """Ids the draft can read: one it lacks (a padded target vocabulary) reads as a substitute."""
        return draftable_ids(token_ids, self.draft_vocab)

    def draft(self, cache: Cache, rows: Sequence[BatchRow], wanted: dict[int, int], chunk: int,
              extend_chains: ExtendChains, observe: ObserveForward) -> dict[int, DraftTree]:
        """Every drafting row's chain, keyed by `id(row)`, from shared draft forwards; a prefilling
        row's draft cache catches up to the end of this step's prompt `chunk`."""
        inputs: list[RowInput] = []
        drafting: list[int] = []
        for index, row in enumerate(rows):
            depth = wanted.get(id(row), 0)
            if depth == 0 and not row.prefilling:
                inputs.append(RowInput([], []))  # the draft catches up when it next drafts
                continue
            inputs.append(self._catch_up(cache, index, row, row.chunk_end(chunk)))
            if depth > 0:
                drafting.append(index)
        if not any(item.token_ids for item in inputs):
            return {}
        logits = _forward(cache, inputs, observe)
        tokens: dict[int, list[int]] = {index: [] for index in drafting}
        log_probs: dict[int, list[float]] = {index: [] for index in drafting}
        rows_q: dict[int, list[torch.Tensor]] = {index: [] for index in drafting}
        # [vocab] the draft's logits for the next position of each drafting row
        current = {index: align_vocab(logits[index][-1:], self.vocab_width)[0] for index in drafting}
        open_rows = list(drafting)
        position = 0
        while open_rows:
            feed: dict[int, int] = {}
            for index in open_rows:
                row = rows[index]
                token = row.draw_draft_token(current[index], position, tokens[index],
                                             log_probs[index], rows_q[index])
                if token is None or len(tokens[index]) >= wanted[id(row)]:
                    continue
                feed[index] = token
            # which chains are worth one more shared draft forward (scheduling.py)
            open_rows = extend_chains([rows[index] for index in feed], list(feed))
            if not open_rows:
                break
            feed = {index: feed[index] for index in open_rows}
            step_inputs = [RowInput([], []) for _ in rows]
            for index, token in feed.items():
                row = rows[index]
                at = len(row.context) + len(row.draft_extra)
                step_inputs[index] = RowInput(self.draftable([token]), [at])
                row.draft_extra.append(token)
            logits = _forward(cache, step_inputs, observe)
            for index in open_rows:
                current[index] = align_vocab(logits[index], self.vocab_width)[0]
            position += 1
        trees = {}
        for index in drafting:
            row = rows[index]
            q = torch.stack(rows_q[index]) if rows_q[index] else None
            trees[id(row)] = DraftTree.chain(tokens[index], log_probs[index], q)
        return trees

    def draft_on_device(self, cache: Cache, rows: Sequence[BatchRow], wanted: dict[int, int],
                        device: torch.device, observe: ObserveForward) -> dict[int, DeviceChain]:
        """Every drafting row's chain of exactly its `wanted` depth, keyed by `id(row)`, each drawn
        token fed to the next shared forward on the device (no row prefills here)."""
        inputs: list[RowInput] = []
        drafting: list[int] = []
        for index, row in enumerate(rows):
            if wanted.get(id(row), 0) == 0:
                inputs.append(RowInput([], []))  # the draft catches up when it next drafts
                continue
            inputs.append(self._catch_up(cache, index, row, len(row.context)))
            drafting.append(index)
        if not drafting:
            return {}
        logits = _forward(cache, inputs, observe)
        # [rows, vocab] each drafting row's logits for its next position
        current = {index: align_vocab(logits[index][-1:], self.vocab_width)[0] for index in drafting}
        drawn: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {i: [] for i in drafting}
        deepest = max(wanted[id(rows[index])] for index in drafting)
        for position in range(deepest):
            feeding = []
            for index in drafting:
                row = rows[index]
                if position >= wanted[id(row)]:
                    continue
                drawn[index].append(_draw(row, current[index]))
                if position + 1 < wanted[id(row)]:
                    feeding.append(index)
            if not feeding:
                break
            steps = [RowInput([], []) for _ in rows]
            for index in feeding:
                at = len(rows[index].context) + position
                steps[index] = RowInput([0], [at])  # the id comes from `ids`, on the device
            ids = torch.zeros(len(rows), 1, dtype=torch.long, device=device)
            feed_index = torch.tensor(feeding, dtype=torch.long, device=ids.device)
            ids[feed_index, 0] = torch.stack([drawn[index][-1][0] for index in feeding])
            logits = _forward(cache, steps, observe, device_ids=ids)
            for index in feeding:
                current[index] = align_vocab(logits[index], self.vocab_width)[0]
        chains = {}
        for index in drafting:
            row = rows[index]
            tokens = torch.stack([token for token, _, _ in drawn[index]])
            scores = torch.stack([score for _, score, _ in drawn[index]])
            probs = torch.stack([q for _, _, q in drawn[index]]) if row.sampling is not None else None
            chains[id(row)] = DeviceChain(tokens, scores, probs)
        return chains

    def _catch_up(self, cache: Cache, index: int, row: BatchRow, end: int) -> RowInput:
        """Row `index`'s input that brings its draft cache up to `end`: the cache keeps what it
        holds of the context (its own drafted tokens the context went on to accept included)."""
        common = row.draft_synced
        for token in row.draft_extra:
            if common < len(row.context) and row.context[common] == token:
                common += 1
            else:
                break
        # never keep the last context token cached: its logits are what we need
        common = min(common, len(row.context) - 1)
        cache.truncate_row(index, common)
        row.draft_synced, row.draft_extra = end, []
        return RowInput(self.draftable(row.context[common:end]), list(range(common, end)))


def _forward(cache: Cache, inputs: list[RowInput], observe: ObserveForward, **kwargs) -> torch.Tensor:
    """One shared draft forward over `inputs`, told to `observe`."""
    started = time.perf_counter()
    logits = cache.forward(inputs, **kwargs)
    observe(sum(1 for item in inputs if item.token_ids), max(len(item.token_ids) for item in inputs),
            time.perf_counter() - started)
    return logits


def _draw(row: BatchRow, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(token, its draft log-probability, q) drawn as the draft model drafter draws it, on the device."""
    if row.sampling is None:
        best, token = logits.log_softmax(dim=-1).max(dim=-1)
        return token, best, None
    q = warp_probs(logits[None], row.sampling)[0]
    token = torch.multinomial(q, 1, generator=row.generator)[0]
    return token, q[token].log(), q
