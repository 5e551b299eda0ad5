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

A mixin of `BatchedSpeculativeEngine` (engine.py), which owns the batch's caches and rows
(`kv`) and `_log_forward`. The lane's caches and rows are a `KVManager` of their own
(`lane_kv`, kv_manager.py).
"""

from __future__ import annotations

import time

from inference.engine.batch.kv_manager import Cache, KVManager
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
        # the lane's caches and the rows each holds (kv_manager.py)
        target = self.runners.new_cache(self.target, self.pack_linear)
        draft = self.runners.new_cache(self.draft, self.pack_linear) if self.draft is not None else None
        self.lane_kv = KVManager(target, draft)
        self._lane_ready: list[BatchRow] = []  # this step's rows whose prompt is cached

    @property
    def lane_rows(self) -> list[BatchRow]:
        """The lane's rows, in its target cache row order (`lane_kv.rows`)."""
        return self.lane_kv.rows

    @property
    def lane_draft_rows(self) -> list[BatchRow]:
        """The lane's `draft_model` rows, in its draft cache row order (`lane_kv.draft_rows`)."""
        return self.lane_kv.draft_rows

    @property
    def lane_target_cache(self) -> Cache:
        """The target's cache of the lane's rows (`lane_kv.target`)."""
        return self.lane_kv.target

    @property
    def lane_draft_cache(self) -> Cache | None:
        """The draft's cache of the lane's draft_model rows (`lane_kv.draft`); None without a draft model."""
        return self.lane_kv.draft

    def _enter_lane(self, row: BatchRow) -> None:
        """A newcomer of the separate mode: into the lane, or straight in when nothing is to cache."""
        if row.prefill_length == 0 or (row.own_schedule and row.prompt_length == 1):
            row.prefilled = row.prompt_length  # its one token is the pending one
            self._add_decoding_row(row)
            return
        # its rows start with the longest cached prefix of its context (prefix_reuse.py)
        self.lane_kv.add(row, row.drafter_kind == "draft_model",
                         lambda target, draft: self.prefixes.open_rows(row, target, draft, self._lane_length(row)))

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
            draft_inputs = [RowInput(self.chain_drafter.draftable(row.context[at[id(row)][0]:at[id(row)][1]]),
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
                result = self.verifier.verdict(row, tree, logits[index])
            except Exception as error:  # a row's own failure ends that row, not the batch
                row.finish_reason, row.error = FINISH_ERROR, f"{type(error).__name__}: {error}"
                result = None
            events.append(self._advance(row, tree, result, seconds, 0.0))
        return events

    def _move_ready_rows(self) -> None:
        """Move the rows whose prompt is cached from the lane into the batch's caches."""
        lane = self.lane_kv
        ready = [row for row in self._lane_ready if lane.index(row) is not None]  # not those that ended
        for row in ready:
            # its prompt, for the sessions that share it (prefix_reuse.py)
            self.prefixes.offer(row, lane.target, lane.index(row), lane.draft, lane.draft_index(row))
            self.kv.adopt(row, lane)  # its keys and values move into the batch's caches
        lane.release(ready)
        self._lane_ready = []
        lane.target.maybe_compact()
