"""Chain drafting for the `draft_model` rows of a batch: every row's chain in shared draft forwards.

A mixin of `BatchedSpeculativeEngine` (engine.py), which owns what it uses: the draft's ragged
cache (`draft_cache`, row i is `draft_rows[i]`; both held by `kv`, kv_manager.py), the step's
prompt chunk, the vocabulary widths and the policy that is told each forward's cost. Each draft
forward feeds every row that still drafts one token (the first one also brings the row's draft
cache up to its context), so rows that stop early (a confidence threshold, their depth, or, under
confidence scheduling, a next position not worth its share of a forward: `_extend_chains`) leave
the others going.
"""

from __future__ import annotations

import time

import torch

from inference.engine.decode.draft_tree import DraftTree
from inference.engine.lm.modeling import align_vocab, draftable_ids
from inference.engine.kv.ragged import RowInput


class ChainDrafting:
    """Drafts the chains of the engine's `draft_model` rows (see the module docstring)."""

    def _draftable(self, token_ids: list[int]) -> list[int]:
        """Ids the draft can read: one it lacks (a padded target vocabulary) reads as a substitute."""
        return draftable_ids(token_ids, self.draft_vocab)

    def _draft_chains(self, wanted: dict[int, int]) -> dict[int, DraftTree]:
        """Draft every draft_model row's chain with shared draft forwards; rows keep in sync."""
        cache = self.draft_cache
        inputs: list[RowInput] = []
        drafting: list[int] = []
        for index, row in enumerate(self.draft_rows):
            depth = wanted.get(id(row), 0)
            if depth == 0 and not row.prefilling:
                inputs.append(RowInput([], []))  # the draft catches up when it next drafts
                continue
            common = row.draft_synced
            for token in row.draft_extra:
                if common < len(row.context) and row.context[common] == token:
                    common += 1
                else:
                    break
            # never keep the last context token cached: its logits are what we need
            common = min(common, len(row.context) - 1)
            cache.truncate_row(index, common)
            end = row.chunk_end(self._chunk)
            inputs.append(RowInput(self._draftable(row.context[common:end]), list(range(common, end))))
            row.draft_synced, row.draft_extra = end, []
            if depth > 0:
                drafting.append(index)
        if not any(item.token_ids for item in inputs):
            return {}
        forward_started = time.perf_counter()
        logits = cache.forward(inputs)
        self._observe_draft(inputs, forward_started)
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
                row = self.draft_rows[index]
                token = row.draw_draft_token(current[index], position, tokens[index],
                                             log_probs[index], rows_q[index])
                if token is None or len(tokens[index]) >= wanted[id(row)]:
                    continue
                feed[index] = token
            # which chains are worth one more shared draft forward (scheduling.py)
            open_rows = self._extend_chains([self.draft_rows[index] for index in feed], list(feed))
            if not open_rows:
                break
            feed = {index: feed[index] for index in open_rows}
            step_inputs = [RowInput([], []) for _ in self.draft_rows]
            for index, token in feed.items():
                row = self.draft_rows[index]
                at = len(row.context) + len(row.draft_extra)
                step_inputs[index] = RowInput(self._draftable([token]), [at])
                row.draft_extra.append(token)
            forward_started = time.perf_counter()
            logits = cache.forward(step_inputs)
            self._observe_draft(step_inputs, forward_started)
            for index in open_rows:
                current[index] = align_vocab(logits[index], self.vocab_width)[0]
            position += 1
        trees = {}
        for index in drafting:
            row = self.draft_rows[index]
            q = torch.stack(rows_q[index]) if rows_q[index] else None
            trees[id(row)] = DraftTree.chain(tokens[index], log_probs[index], q)
        return trees

    def _observe_draft(self, inputs: list[RowInput], started: float) -> None:
        self._log_forward("draft", sum(1 for item in inputs if item.token_ids),
                          max(len(item.token_ids) for item in inputs), time.perf_counter() - started)
