"""Prompts prefilled in forwards of their own, so a newcomer never widens the decoding rows' forward.

Every row of a ragged forward is as wide as its widest row (kv/ragged.py). On a CPU, where a
forward costs about rows x tokens, a newcomer's prompt chunk beside decoding rows pads all of
them: 16 rows x 8 tokens took 39.6 ms against 22.8 ms for 16 x 4 on the demo pair, and with
speculative rows finishing one at a time nearly every step carried a chunk. In the separate
mode (the default on a CPU) a newcomer waits in the prefill lane: caches of its own (target,
and draft for `draft_model` rows) that take `prefill_chunk` prompt tokens a step in a forward
of the prefilling rows only (logits only for a row's last prompt token: its first token comes
from the lane, so the time to first token is the prefill's). Then the row's keys and values
move into the batch's caches (`RaggedCache.adopt_row`) and it decodes from the next step on.
A seeded sampled row leaves its last prompt token pending and drafts on its first decoding
step, as it does alone, so its tokens do not depend on the mode. On a GPU padding is nearly free and one shared forward costs less than
two, so the shared mode (the newcomer's chunk in the decoding rows' forward) is its default.

A mixin of `BatchedSpeculativeEngine` (engine.py), which owns the main caches, the rows and
`_log_forward`.
"""

from __future__ import annotations

import time

from inference.engine.batch.rows import FINISH_ERROR, BatchRow, RowEvent
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.outputs import StepOutput
from inference.engine.kv.ragged import RowInput

PREFILL_SHARED = "shared"
PREFILL_SEPARATE = "separate"
PREFILL_MODES = (PREFILL_SHARED, PREFILL_SEPARATE)


def default_prefill_mode(device) -> str:
    """Where a newcomer's prompt runs, by device (see the module docstring)."""
    return PREFILL_SHARED if device.type == "cuda" else PREFILL_SEPARATE


class PrefillLane:
    """The prefill lane of the engine's separate mode (see the module docstring)."""

    def _init_prefill_lane(self) -> None:
        self.lane_rows: list[BatchRow] = []  # lane target cache row i is lane_rows[i]
        self.lane_draft_rows: list[BatchRow] = []  # lane draft cache row i is lane_draft_rows[i]
        self.lane_target_cache = self.runners.new_cache(self.target, self.pack_linear)
        self.lane_draft_cache = self.runners.new_cache(self.draft, self.pack_linear) if self.draft is not None else None
        self._lane_ready: list[BatchRow] = []  # this step's rows whose prompt is cached

    def _enter_lane(self, row: BatchRow) -> None:
        """A newcomer of the separate mode: into the lane, or straight in when nothing is to cache."""
        if row.prefill_length == 0 or (row.own_schedule and row.prompt_length == 1):
            row.prefilled = row.prompt_length  # its one token is the pending one
            self._add_decoding_row(row, None)
            return
        drafts = row.drafter_kind == "draft_model"
        # its rows start with the longest cached prefix of its context (prefix_reuse.py)
        self.prefixes.open_rows(row, self.lane_target_cache, self.lane_draft_cache if drafts else None,
                                self._lane_length(row))
        self.lane_rows.append(row)
        if drafts:
            self.lane_draft_rows.append(row)

    @staticmethod
    def _lane_length(row: BatchRow) -> int:
        """Context tokens the lane caches: the whole prompt, its first token coming from the last
        chunk's logits; but a seeded sampled row keeps its last prompt token pending, so that it
        drafts on its first step as it does alone (its tokens must not depend on the mode)."""
        return row.prompt_length - 1 if row.own_schedule else row.prefill_length

    def _prefill_lane_step(self, chunk: int) -> list[RowEvent]:
        """Feed every lane row its next `chunk` prompt tokens (a row whose prompt is done gets its
        first token); return an event per lane row. Rows done wait in `_lane_ready` to move."""
        self._lane_ready: list[BatchRow] = []
        if not self.lane_rows:
            return []
        started = time.perf_counter()
        ends = [min(self._lane_length(row), row.prefilled + chunk) for row in self.lane_rows]
        inputs = [RowInput(row.context[row.prefilled:end], list(range(row.prefilled, end)))
                  for row, end in zip(self.lane_rows, ends)]
        first_tokens = any(end == row.prompt_length for row, end in zip(self.lane_rows, ends))
        with self._tapping(self.lane_rows) as tap:  # a DSpark row's prompt features (feature_rows.py)
            logits = self.lane_target_cache.forward(inputs, logits="last" if first_tokens else "none")
        self._hand_over(tap, self.lane_rows, inputs, [list(range(len(item.token_ids))) for item in inputs])
        self._log_forward("prefill", len(inputs), max(len(item.token_ids) for item in inputs),
                          time.perf_counter() - started, costed=False)
        if self.lane_draft_rows:
            # the draft never caches the last context token (chain_drafting.py), so stops short of it
            at = {id(row): (row.prefilled, min(end, row.prompt_length - 1))
                  for row, end in zip(self.lane_rows, ends)}
            draft_inputs = [RowInput(self._draftable(row.context[at[id(row)][0]:at[id(row)][1]]),
                                     list(range(*at[id(row)])))
                            for row in self.lane_draft_rows]
            if any(item.token_ids for item in draft_inputs):
                draft_started = time.perf_counter()
                self.lane_draft_cache.forward(draft_inputs, logits="none")
                self._log_forward("draft_prefill", sum(1 for item in draft_inputs if item.token_ids),
                                  max(len(item.token_ids) for item in draft_inputs),
                                  time.perf_counter() - draft_started, costed=False)
            for row in self.lane_draft_rows:
                row.draft_synced, row.draft_extra = at[id(row)][1], []
        seconds = time.perf_counter() - started
        events = []
        for index, (row, end) in enumerate(zip(self.lane_rows, ends)):
            row.fed_prompt = end - row.prefilled
            row.prefilled = end
            if end < self._lane_length(row):
                events.append(self._event(row, StepOutput([], 0, 0, [], None), prefill_tokens=row.fed_prompt))
                continue
            self._lane_ready.append(row)
            if row.own_schedule or row.keeps_last_prompt_token:
                row.prefilled = row.prompt_length  # the last prompt token is the pending one
                events.append(self._event(row, StepOutput([], 0, 0, [], None), prefill_tokens=row.fed_prompt))
                continue
            tree = DraftTree.empty()
            row.depth_choices[0] = row.depth_choices.get(0, 0) + 1  # a step of its own, undrafted
            try:
                result = self._verdict(row, tree, logits[index])
            except Exception as error:  # a row's own failure ends that row, not the batch
                row.finish_reason, row.error = FINISH_ERROR, f"{type(error).__name__}: {error}"
                result = None
            events.append(self._advance(row, tree, result, seconds, 0.0))
        return events

    def _move_ready_rows(self) -> None:
        """Move the rows whose prompt is cached from the lane into the batch's caches."""
        ready = [row for row in self._lane_ready if row in self.lane_rows]  # not those that ended
        for row in ready:
            draft_index = self.lane_draft_rows.index(row) if row.drafter_kind == "draft_model" else None
            # its prompt, for the sessions that share it (prefix_reuse.py)
            self.prefixes.offer(row, self.lane_target_cache, self.lane_rows.index(row), self.lane_draft_cache,
                                draft_index)
            self._add_decoding_row(row, (self.lane_rows.index(row), draft_index))
        self._leave_lane(ready)
        self._lane_ready = []
        self.lane_target_cache.maybe_compact()

    def _leave_lane(self, rows: list[BatchRow]) -> None:
        """Drop `rows` from the lane (moved into the batch, cancelled or timed out)."""
        leaving = {id(row) for row in rows}
        keep = [index for index, row in enumerate(self.lane_rows) if id(row) not in leaving]
        if len(keep) != len(self.lane_rows):
            self.lane_target_cache.keep_rows(keep)
            self.lane_rows = [self.lane_rows[index] for index in keep]
        keep = [index for index, row in enumerate(self.lane_draft_rows) if id(row) not in leaving]
        if len(keep) != len(self.lane_draft_rows):
            self.lane_draft_cache.keep_rows(keep)
            self.lane_draft_rows = [self.lane_draft_rows[index] for index in keep]
