"""Confidence-scheduled verification in the batching engine: plan the drafts, cut them, learn.

A mixin of `BatchedSpeculativeEngine` (engine.py), which owns what it uses: the rows, the
policy (cost models, acceptance trackers), the step's prompt chunk and `_context_new`,
`_depth_cap`. With `policy.enabled` and `policy.confidence_scheduling`, a step of the batch:

1. plans each scheduled row's draft depth (`_plan_draft_depths`): as deep as the policy allows
   (`max_depth`, the tokens and the draft's context left) but no deeper than a position can pay
   for its own drafting and verifying: a position worth a expected tokens costs, per row, its
   share of a draft forward (or the drafter's own seconds per position) and of the verify
   forward's extra width, and pays only if a exceeds that cost times the undrafted step's
   tokens per second (`_survival_floor`). A `draft_model` chain applies the floor while it
   drafts, position by position, from calibrated confidences (rows.py `_survives`); a per-row
   drafter gets the deepest depth its running acceptance keeps over the floor;
2. after drafting, cuts each scheduled row's draft to the length the scheduler chose
   (`_schedule`, confidence_schedule.py) against the cost the forward will really have: rows
   are padded to the widest (`PaddedForwardCost`, so the scheduler admits whole levels), the
   drafting already paid counts as fixed;
3. after verifying, teaches the draft_model chain calibration and records per row the length
   verified, the survival it expected and what was accepted (`_observe_schedule`).

Scheduled rows: decoding rows of the policy (not a seeded sampled row, which keeps its own
schedule so its tokens do not depend on its companions; not a row still feeding its prompt).
Greedy and unseeded sampled rows alike: every estimate is known before the token it decides
about (survival.py), so sampling stays exact (tests/inference/engine/test_scheduler_lossless.py).
"""

from __future__ import annotations

from inference.engine.batch.confidence_schedule import PaddedForwardCost, Schedule, schedule
from inference.engine.batch.policy import PolicyDecision
from inference.engine.batch.rows import BatchRow
from inference.engine.batch.survival import SurvivalEstimates
from inference.engine.decode.draft_tree import DraftTree


class ConfidenceScheduling:
    """Per-row verification lengths for the engine's rows (see the module docstring)."""

    def _init_scheduling(self) -> None:
        self.survival = SurvivalEstimates(self.policy)
        self.last_schedule: Schedule | None = None
        self._scheduled_ids: set[int] = set()
        self._draft_depths: dict[int, int] = {}
        self._exploring = False

    @property
    def scheduling(self) -> bool:
        """Whether this engine's steps run the confidence scheduler."""
        return self.policy.enabled and self.policy.confidence_scheduling

    def _is_scheduled(self, row: BatchRow) -> bool:
        return (not row.own_schedule and not row.prefilling and row.can_draft(self._chunk)
                and row.drafter_kind != "none")

    # -- 1. planning the drafts ----------------------------------------------------------

    def _plan_draft_depths(self) -> int:
        """Each scheduled row's draft depth for this step; returns the deepest."""
        self._scheduled_ids = {id(row) for row in self.rows if self._is_scheduled(row)}
        self._draft_depths = {}
        self._exploring = bool(self._scheduled_ids) and self.policy.explore_now()
        rows = len(self.rows)
        width = max([1] + [len(self._context_new(row)) for row in self.rows])
        chains = sum(1 for row in self.rows
                     if id(row) in self._scheduled_ids and row.drafter_kind == "draft_model")
        for row in self.rows:
            row.survival_floor, row.confidence_of = 0.0, None
            if id(row) not in self._scheduled_ids:
                continue
            cap = self._depth_cap(row)
            sampled = row.sampling is not None
            if self._exploring:
                floor = 0.0
            elif row.drafter_kind == "draft_model":
                floor = self._survival_floor(rows, width, self.policy.draft_costs.estimate(chains, 1) / chains)
            else:
                floor = self._survival_floor(rows, width, self.policy.row_draft_seconds.get(row.drafter_kind, 0.0))
            if row.drafter_kind == "draft_model":
                row.survival_floor = floor
                row.confidence_of = (lambda top, sampled=sampled: self.survival.confidence(top, sampled))
                depth = cap
            else:
                tracker = self.policy.tracker(row.drafter_kind, sampled)
                depth, survive = 0, 1.0
                while depth < cap:
                    survive *= tracker.rate(depth)
                    if survive < floor and depth > 0:
                        break
                    depth += 1
            self._draft_depths[id(row)] = depth
        return max(self._draft_depths.values(), default=0)

    def _survival_floor(self, rows: int, width: int, draft_seconds_per_row: float) -> float:
        """The survival a drafted position needs to pay for its drafting and its share of a
        verify forward as wide as `max_depth` drafts, at the undrafted step's tokens per second."""
        depth = max(1, self.policy.max_depth)
        undrafted = self.policy.forward_seconds(rows, width)
        if undrafted <= 0:
            return 0.0
        deepest = self.policy.forward_seconds(rows, max(width, depth + 1))
        verify_per_token = max(0.0, deepest - undrafted) / (depth * rows)
        return (draft_seconds_per_row + verify_per_token) * rows / undrafted

    def _scheduled_depth(self, row: BatchRow) -> int:
        return self._draft_depths.get(id(row), 0)

    # -- 2. cutting the drafts -------------------------------------------------------------

    def _schedule(self, trees: list[DraftTree], draft_seconds: float) -> list[DraftTree]:
        """Cut every scheduled row's draft to the length the prefix scheduler admits."""
        scheduled = [index for index, row in enumerate(self.rows) if id(row) in self._scheduled_ids]
        survival, row_tokens = [], []
        floor_width, base_tokens = 1, 0.0
        for index, (row, tree) in enumerate(zip(self.rows, trees)):
            new = len(self._context_new(row))
            sampled = row.sampling is not None
            if id(row) in self._scheduled_ids:
                survival.append(self.survival.of_tree(row.drafter_kind, tree, sampled))
                row_tokens.append([new + tree.nodes_up_to(depth) for depth in range(tree.max_depth + 1)])
                base_tokens += 1.0
                continue
            floor_width = max(floor_width, new + len(tree))
            if row.can_draft(self._chunk):  # it yields a token this step, and its own drafts'
                base_tokens += 1.0 + sum(self.survival.of_tree(row.drafter_kind, tree, sampled))
        cost = PaddedForwardCost(self.policy.forward_seconds, len(self.rows), row_tokens, floor_width,
                                 fixed_seconds=draft_seconds)
        chosen = schedule(survival, cost, base_tokens)
        lengths = list(chosen.lengths)
        if self._exploring and not any(lengths):
            # re-measure: every drafted row verifies its first position
            lengths = [min(1, len(estimates)) for estimates in survival]
        self.last_schedule = chosen
        self.last_decision = PolicyDecision(max(lengths, default=0), chosen.expected_tokens,
                                            chosen.seconds, explored=self._exploring)
        could = any(survival)
        self.policy.record_verified(any(lengths) and not self._exploring, could)
        trees = list(trees)
        for position, index in enumerate(scheduled):
            row, length = self.rows[index], lengths[position]
            cut = trees[index].prefix(length)
            row.scheduled_expected = sum(survival[position][:length])
            row.scheduled_cut = len(trees[index]) - len(cut)
            row.depth_choices[length] = row.depth_choices.get(length, 0) + 1
            trees[index] = cut
        return trees

    # -- 3. learning from the verdicts -----------------------------------------------------

    def _observe_schedule(self, row: BatchRow, tree: DraftTree, accepted: int) -> None:
        """After a scheduled row's verdict: calibration tables and the row's stats."""
        if row.scheduled_expected is None:
            return
        self.survival.observe(row.drafter_kind, tree, row.sampling is not None, accepted)
        row.stats.record_schedule(tree.max_depth, row.scheduled_expected, accepted, row.scheduled_cut)
