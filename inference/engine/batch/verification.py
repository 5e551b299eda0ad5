"""Verification for every row of a batch: one target forward, a verdict per row, the row advanced.

A mixin of `BatchedSpeculativeEngine` (engine.py): the step's forward and what it commits, over
what the engine owns: the target's ragged cache (`target_cache`, row i is `rows[i]`; both held
by `kv`, kv_manager.py), the step's prompt chunk, `_log_forward`, `_event` and the confidence
scheduler (`confidence`, scheduling.py), which learns from each verdict. Each row feeds its new
context tokens (a prompt chunk, or its pending token) and its draft tree; the verifier
(`verifier`, verifier.py: greedy, or the rejection rule for sampled rows, under the row's
grammar) judges each row from the forward's logits, the row keeps its accepted path, and the
rejected nodes become holes in the cache.

The forward stays here, not in the verifier: which cache it runs on, the DSpark rows' feature
tap around it and the cost model it feeds are the engine's, and the verifier needs none of them.
"""

from __future__ import annotations

import time

import torch

from inference.engine.batch.rows import FINISH_ERROR, BatchRow, RowEvent
from inference.engine.constraints.matcher import GrammarStateError, commit_step
from inference.engine.decode.decoder import branches_of
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.verify import VerifyResult
from inference.engine.kv.ragged import RowInput
from inference.engine.outputs import StepOutput


class RowVerification:
    """Verifies the drafts of the engine's rows in one target forward (see the module docstring)."""

    def _context_new(self, row: BatchRow) -> list[int]:
        """The context tokens the row feeds the target this step (a prompt chunk, or the pending one)."""
        return row.context[row.cached:row.chunk_end(self._chunk)]

    def _constrain(self, row: BatchRow, tree: DraftTree) -> tuple[DraftTree, torch.Tensor | None]:
        """A constrained row's tree to verify and its masks [1 + nodes, vocab_size] (the verifier's
        `constrain`); an unconstrained row's tree and None."""
        row.forced_step = False
        if row.matcher is None or not row.can_draft(self._chunk):
            return tree, None  # no verdict this step without the whole context in the forward
        constrained = self.verifier.constrain(row.matcher, tree, row.room)
        if constrained.forced:  # forced tokens, not the drafter's: always accepted, not scheduled
            row.forced_step, row.scheduled_expected = True, None
        return constrained.tree, constrained.allowed

    def _verify(self, trees: list[DraftTree]) -> list[VerifyResult | None]:
        """One target forward for every row; the verdict per row (None: a prefill chunk).

        A constrained row's tree is replaced in `trees` by the one verified (`_constrain`)."""
        inputs, masks = [], []
        for index, row in enumerate(self.rows):
            try:
                trees[index], allowed = self._constrain(row, trees[index])
            except Exception as error:  # raised at its verdict: the row ends, not the batch
                trees[index], allowed = DraftTree.empty(), error
            tree = trees[index]
            masks.append(allowed)
            context_new = self._context_new(row)
            cached, new = row.cached, len(context_new)
            new_mask = None
            if not tree.is_chain:
                new_mask = torch.ones(new + len(tree), new + len(tree), dtype=torch.bool).tril_()
                new_mask[new:, new:] = tree.ancestor_matrix()
            last = cached + new - 1
            positions = list(range(cached, cached + new)) + [last + depth for depth in tree.depths]
            inputs.append(RowInput(context_new + tree.token_ids, positions, new_mask))
        forward_started = time.perf_counter()
        with self._tapping(self.rows) as tap:  # a DSpark row's features (feature_rows.py)
            logits = self.target_cache.forward(inputs)
        self._log_forward("target", len(inputs), max(len(item.token_ids) for item in inputs),
                          time.perf_counter() - forward_started)
        start = self.target_cache.last_start
        results: list[VerifyResult | None] = []
        # per row, the input indices this forward committed (its fed context, its accepted nodes)
        committed: list[list[int] | None] = []
        for index, (row, tree, row_logits) in enumerate(zip(self.rows, trees, logits)):
            new = len(inputs[index].token_ids) - len(tree)
            committed.append(list(range(new)))
            if row.prefilling:
                row.fed_prompt = new
                row.note_prefilled(new)
                if row.prefilling or row.keeps_last_prompt_token:
                    results.append(None)  # no verdict: the row's last token is not in this forward
                    continue
            # [1 + nodes, vocab]: after the last context token, then after each node
            row_logits = row_logits[new - 1:]
            try:
                if isinstance(masks[index], Exception):  # its grammar failed before the forward
                    raise masks[index]
                result = self.verifier.verdict(row, tree, row_logits, masks[index])
            except Exception as error:  # a row's own failure ends that row, not the batch
                row.finish_reason, row.error = FINISH_ERROR, f"{type(error).__name__}: {error}"
                results.append(None)
                committed[-1] = None
                continue
            committed[-1] += [new + node for node in result.accepted_nodes]
            if len(tree):
                accepted = set(result.accepted_nodes)
                rejected = [start + new + node for node in range(len(tree)) if node not in accepted]
                self.target_cache.drop(index, rejected)
            results.append(result)
        self._hand_over(tap, self.rows, inputs, committed)
        return results

    def _advance(self, row: BatchRow, tree: DraftTree, result: VerifyResult | None, step_seconds: float,
                 draft_seconds: float) -> RowEvent:
        if result is None:
            # still prefilling (or failed): no tokens this step
            return self._event(row, StepOutput([], 0, 0, [], row.finish_reason), prefill_tokens=row.fed_prompt)
        accepted = len(result.accepted_nodes)
        new_tokens = [tree.token_ids[node] for node in result.accepted_nodes] + [result.next_token]
        try:
            emitted, finish_reason = commit_step(row.matcher, row.stop, row.generated, new_tokens)
        except GrammarStateError as error:  # a bug, never input: the row ends, not the batch
            emitted, finish_reason, row.error = [], FINISH_ERROR, f"{type(error).__name__}: {error}"
        row.generated.extend(emitted)
        row.context.extend(emitted)
        row.finish_reason = finish_reason
        if tree.max_depth and not row.forced_step:  # forced tokens say nothing of the drafter
            row.schedule.update(tree.max_depth, accepted)
            self.policy.observe_acceptance(row.drafter_kind, tree.max_depth, accepted,
                                           sampled=row.sampling is not None)
        self.confidence.observe(row, tree, accepted)  # a scheduled row's calibration and stats
        stats = row.stats
        stats.record_step(len(tree), tree.max_depth, accepted)
        stats.new_tokens = len(row.generated)
        stats.draft_seconds += draft_seconds
        stats.verify_seconds += step_seconds - draft_seconds
        stats.total_seconds = time.perf_counter() - row.started
        bonus = bool(tree.max_depth) and not tree.children[result.accepted_nodes[-1] + 1] \
            if result.accepted_nodes else False
        step = StepOutput(emitted, len(tree), accepted, branches_of(tree, result.accepted_nodes),
                          finish_reason)
        scheduled = row.scheduled_expected is not None
        return self._event(row, step, bonus, prefill_tokens=row.fed_prompt,
                           verified_depth=tree.max_depth if scheduled else None,
                           expected_accepted=row.scheduled_expected)
