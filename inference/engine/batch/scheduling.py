"""Confidence-scheduled verification in the batching engine: plan the drafts, cut them, learn.

`ConfidenceScheduler` is a component `BatchedSpeculativeEngine` (engine.py) holds
(`engine.confidence`); it holds no engine. It owns the policy it plans with (cost models,
acceptance trackers, the exploration counter), the survival estimates (`survival`) and this
step's plan: which rows it schedules, each one's draft depth, whether the step explores, and
what the planned drafting costs. The engine owns the rows and the caches and hands each call
what it needs: the rows (the draft cache's too), the step's prompt chunk, each row's new
context tokens this step, and two functions of a row, its depth cap (`_depth_cap`: its tokens
left, the draft's positions) and the depth it drafts this step (`_row_depth`, which reads
`depth` for a scheduled row). With `policy.enabled` and `policy.confidence_scheduling`
(`enabled`), a step of the batch:

1. plans each scheduled row's draft depth (`plan`): as deep as the policy allows (`max_depth`,
   the tokens and the draft's context left) but no deeper than a position can pay for its own
   drafting and verifying: a position worth a expected tokens costs its drafting and its share
   of the verify forward's extra width, and pays only if a exceeds that cost times the
   undrafted step's tokens per second (`_plan_rates`). `draft_model` chains decide before each
   shared draft forward which of them it extends, from their calibrated running survival
   (`extend_chains`, which the engine hands the chain drafter, chain_drafting.py); a per-row drafter gets
   the deepest depth its running acceptance keeps over its own floor;
2. after drafting, cuts each scheduled row's draft to the length the scheduler chose (`cut`;
   `schedule`, confidence_schedule.py) against the cost the forward will really have: rows are
   padded to the widest (`PaddedForwardCost`, so the scheduler admits whole levels), but for
   the linear layers' share under `pack_linear`; the drafting planned counts as fixed;
3. after verifying, teaches the draft_model chain calibration and records per row the length
   verified, the survival it expected and what was accepted (`observe`).

Scheduled rows: decoding rows of the policy (not a seeded sampled row, which keeps its own
schedule so its tokens do not depend on its companions; not a row still feeding its prompt).
Greedy and unseeded sampled rows alike: every estimate is known before the token it decides
about (survival.py), so sampling stays exact (tests/inference/engine/test_scheduler_lossless.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from inference.engine.batch.confidence_schedule import PaddedForwardCost, Schedule, schedule
from inference.engine.batch.policy import PolicyDecision, SpeculationPolicy
from inference.engine.batch.rows import BatchRow
from inference.engine.batch.survival import SurvivalEstimates
from inference.engine.decode.draft_tree import DraftTree


# The share of a forward's time in its linear layers, which take real tokens only under the
# engine's `pack_linear` (attention stays padded): about half a step on this CPU
# (../shared/DESIGN.md, "DSpark").
LINEAR_SHARE = 0.5

# a row's depth: its cap (`_depth_cap`), or what it drafts this step (`_row_depth`)
RowDepth = Callable[[BatchRow], int]


class ConfidenceScheduler:
    """Per-row verification lengths for the engine's rows (see the module docstring).

    policy: the engine's speculation policy; pack_linear: whether the engine's ragged forwards
    run the linear layers on real tokens only (the cut then costs that share by real tokens)."""

    def __init__(self, policy: SpeculationPolicy, pack_linear: bool = False) -> None:
        self.policy = policy
        self.packed_share = LINEAR_SHARE if pack_linear else 0.0
        self.survival = SurvivalEstimates(policy)
        self.last_schedule: Schedule | None = None
        self._scheduled_ids: set[int] = set()
        self._draft_depths: dict[int, int] = {}
        self._exploring = False
        self._planned_draft_seconds = 0.0
        self._token_rate = 0.0
        self._verify_per_token = 0.0

    @property
    def enabled(self) -> bool:
        """Whether the engine's steps run the confidence scheduler."""
        return self.policy.enabled and self.policy.confidence_scheduling

    @property
    def any_scheduled(self) -> bool:
        """Whether the last plan scheduled any row."""
        return bool(self._scheduled_ids)

    def scheduled(self, row: BatchRow) -> bool:
        """Whether the last plan scheduled `row`."""
        return id(row) in self._scheduled_ids

    def depth(self, row: BatchRow) -> int:
        """The draft depth the last plan gave `row` (0 for a row it did not schedule)."""
        return self._draft_depths.get(id(row), 0)

    @staticmethod
    def _is_scheduled(row: BatchRow, chunk: int) -> bool:
        return (not row.own_schedule and not row.prefilling and row.can_draft(chunk)
                and row.drafter_kind != "none")

    # -- 1. planning the drafts ----------------------------------------------------------

    def plan(self, rows: Sequence[BatchRow], draft_rows: Sequence[BatchRow], chunk: int,
             new_tokens: Sequence[int], depth_cap: RowDepth, drafts: RowDepth) -> int:
        """Each scheduled row's draft depth for this step; returns the deepest.

        rows: the batch's rows, new_tokens[i] the context tokens rows[i] feeds the target this
        step; draft_rows: the draft cache's rows; chunk: the step's prompt chunk; depth_cap: the
        deepest draft a row can take; drafts: the depth a row drafts this step (read after the
        depths are set, for a row this plan schedules)."""
        self._scheduled_ids = {id(row) for row in rows if self._is_scheduled(row, chunk)}
        self._draft_depths = {}
        self._exploring = bool(self._scheduled_ids) and self.policy.explore_now()
        self._plan_rates(len(rows), max([1, *new_tokens]))
        chains: list[tuple[float, int]] = []
        for row in rows:
            row.confidence_of = None
            if id(row) not in self._scheduled_ids:
                continue
            cap = depth_cap(row)
            sampled = row.sampling is not None
            if self._exploring:
                # re-measure cheaply: one position each (a draft forward, a verify column)
                self._draft_depths[id(row)] = min(cap, 1)
                continue
            if row.drafter_kind == "draft_model":
                # its chain goes as deep as each next shared draft forward pays (`extend_chains`)
                row.confidence_of = (lambda top, sampled=sampled: self.survival.confidence(top, sampled))
                chains.append((self.survival.expected_confidence(sampled), id(row)))
                self._draft_depths[id(row)] = cap
                continue
            self._draft_depths[id(row)] = self._row_drafter_depth(row, cap, sampled)
        if chains and not self._exploring:
            # the first draft forward (it brings each row's draft cache up to its context and
            # gives its first position) runs only for chains whose first position pays for it,
            # at the overall calibrated confidence; the others draft nothing this step
            feeding = sum(1 for row in draft_rows if id(row) not in self._scheduled_ids
                          and (row.prefilling or drafts(row) > 0))
            drafting = set(self._worth_a_draft_forward(chains, feeding))
            for _, key in chains:
                if key not in drafting:
                    self._draft_depths[key] = 0
        self._planned_draft_seconds = self._planned_drafting(rows, draft_rows, drafts)
        return max(self._draft_depths.values(), default=0)

    def _row_drafter_depth(self, row: BatchRow, cap: int, sampled: bool) -> int:
        """A per-row drafter's depth: the deepest its running acceptance keeps over its floor."""
        draft_seconds = self.policy.row_draft_seconds.get(row.drafter_kind, 0.0)
        floor = self._token_rate * (draft_seconds + self._verify_per_token)
        tracker = self.policy.tracker(row.drafter_kind, sampled)
        depth, survive = 0, 1.0
        while depth < cap:
            survive *= tracker.rate(depth)
            if survive < floor and depth > 0:
                break
            depth += 1
        return depth

    def _planned_drafting(self, rows: Sequence[BatchRow], draft_rows: Sequence[BatchRow],
                          drafts: RowDepth) -> float:
        """What this step's drafting is planned to cost, as the schedule counts it: the first
        shared draft forward (if any chain drafts) and the per-row drafters' positions. Known
        before any token is drafted: the measured drafting time is not used, since how far the
        chains went (hence how long drafting took) depends on their tokens, and a decision about
        position 1 that read it would read the tokens after it."""
        chains = sum(1 for row in draft_rows if row.prefilling or drafts(row) > 0)
        seconds = self.policy.draft_costs.estimate(chains, 1) if chains else 0.0
        for row in rows:
            depth = self._draft_depths.get(id(row), 0)
            if depth and row.drafter_kind != "draft_model":
                seconds += depth * self.policy.row_draft_seconds.get(row.drafter_kind, 0.0)
        return seconds

    def _plan_rates(self, rows: int, width: int) -> None:
        """What a drafted position is weighed against this step: the undrafted step's tokens per
        second, and a verify token's share of a forward as wide as `max_depth` drafts."""
        depth = max(1, self.policy.max_depth)
        undrafted = self.policy.forward_seconds(rows, width)
        deepest = self.policy.forward_seconds(rows, max(width, depth + 1))
        self._token_rate = rows / undrafted if undrafted > 0 else 0.0
        self._verify_per_token = max(0.0, deepest - undrafted) / (depth * rows)

    def extend_chains(self, rows: list[BatchRow], indices: list[int]) -> list[int]:
        """Of the draft_model chains that could draft one more position, the `indices` of those
        worth the next shared draft forward.

        Rows outside the schedule (a seeded row's own schedule) always go on. Scheduled ones are
        taken in order of the survival their next position is predicted to have (the running
        survival times the last position's confidence: known before the next token is drawn),
        as many as maximise the expected tokens gained minus what the forward and their verify
        columns cost, in tokens at the undrafted step's rate. A forward that runs for one row
        costs that row the whole forward: weighing each row against its share of a forward let
        a lone confident chain draft on by itself, a whole forward per position.
        """
        if not self.enabled or self._exploring:
            return indices
        fixed = [index for row, index in zip(rows, indices) if id(row) not in self._scheduled_ids]
        scored = [(row.draft_survival * row.last_confidence, index) for row, index in zip(rows, indices)
                  if id(row) in self._scheduled_ids]
        return fixed + self._worth_a_draft_forward(scored, len(fixed))

    def _worth_a_draft_forward(self, scored: list[tuple[float, int]], fixed: int) -> list[int]:
        """The keys of the (predicted survival, key) chains to feed the next draft forward: the
        most likely first, as many as maximise the expected tokens they add minus what the
        forward (beyond the `fixed` rows it feeds anyway) and their verify columns cost, in
        tokens at the undrafted step's rate."""
        costs = self.policy.draft_costs

        def forward(count: int) -> float:
            return costs.estimate(count, 1) if count else 0.0

        ranked = sorted(scored, reverse=True)
        best, best_net, gain = 0, 0.0, 0.0
        for count, (survival, _) in enumerate(ranked, start=1):
            gain += survival - self._token_rate * self._verify_per_token
            net = gain - self._token_rate * (forward(fixed + count) - forward(fixed))
            if net > best_net:
                best, best_net = count, net
        return [key for _, key in ranked[:best]]

    # -- 2. cutting the drafts -------------------------------------------------------------

    def cut(self, rows: Sequence[BatchRow], trees: Sequence[DraftTree], chunk: int, new_tokens: Sequence[int],
            depth_cap: RowDepth) -> tuple[list[DraftTree], PolicyDecision]:
        """Cut every scheduled row's draft to the length the prefix scheduler admits; the trees
        to verify (trees[i] is rows[i]'s) and the step's decision.

        chunk, new_tokens, depth_cap: as `plan`'s. The decision counts the planned drafting, not
        the step's measured time so far (`_planned_drafting` says why)."""
        scheduled = [index for index, row in enumerate(rows) if id(row) in self._scheduled_ids]
        survival, row_tokens = [], []
        floor_width, base_tokens, other_tokens = 1, 0.0, 0
        for row, tree, new in zip(rows, trees, new_tokens):
            sampled = row.sampling is not None
            if id(row) in self._scheduled_ids:
                survival.append(self.survival.of_tree(row.drafter_kind, tree, sampled))
                row_tokens.append([new + tree.nodes_up_to(depth) for depth in range(tree.max_depth + 1)])
                base_tokens += 1.0
                continue
            floor_width = max(floor_width, new + len(tree))
            other_tokens += new + len(tree)
            if row.can_draft(chunk):  # it yields a token this step, and its own drafts'
                base_tokens += 1.0 + sum(self.survival.of_tree(row.drafter_kind, tree, sampled))
        cost = PaddedForwardCost(self.policy.forward_seconds, len(rows), row_tokens, floor_width,
                                 fixed_seconds=self._planned_draft_seconds, packed_share=self.packed_share,
                                 other_tokens=other_tokens)
        chosen = schedule(survival, cost, base_tokens)
        lengths = list(chosen.lengths)
        if self._exploring and not any(lengths):
            # re-measure: every drafted row verifies its first position
            lengths = [min(1, len(estimates)) for estimates in survival]
        self.last_schedule = chosen
        decision = PolicyDecision(max(lengths, default=0), chosen.expected_tokens, chosen.seconds,
                                  explored=self._exploring)
        # a step counts towards the next exploration when a scheduled row could have drafted
        could = any(depth_cap(rows[index]) > 0 for index in scheduled)
        self.policy.record_verified(any(lengths) and not self._exploring, could)
        trees = list(trees)
        for position, index in enumerate(scheduled):
            row, length = rows[index], lengths[position]
            cut = trees[index].prefix(length)
            row.scheduled_expected = sum(survival[position][:length])
            row.scheduled_cut = len(trees[index]) - len(cut)
            row.depth_choices[length] = row.depth_choices.get(length, 0) + 1
            trees[index] = cut
        return trees, decision

    # -- 3. learning from the verdicts -----------------------------------------------------

    def observe(self, row: BatchRow, tree: DraftTree, accepted: int) -> None:
        """After a row's verdict: a scheduled row teaches the calibration tables and its stats."""
        if row.scheduled_expected is None:
            return
        self.survival.observe(row.drafter_kind, tree, row.sampling is not None, accepted)
        row.stats.record_schedule(tree.max_depth, row.scheduled_expected, accepted, row.scheduled_cut)
