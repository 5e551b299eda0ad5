"""A decode step that reads the device once: chains drafted, verified and judged on the device.

A step of the host path reads values back many times: every drafted token of every row (the
next draft forward is fed from Python lists), every row's argmax, every uniform of the rejection
rule. On a GPU each read waits for the queue to drain. When every row of the step drafts a chain
whose length is known before drafting — no grammar, no confidence cut-off, no confidence
scheduler deciding from values as they are drawn, no feature-reading drafter — the whole step
runs on the device instead:

1. each row's draft length comes from host state (the policy's depth, a seeded row's own
   schedule); n-gram and suffix rows draft on the host as always (their tokens never were on
   the device);
2. the `draft_model` rows draft together, one shared draft forward per position, each next
   input the previous forward's draw, still on the device (the drafted token of a row is drawn
   exactly as the draft model drafter draws it alone: argmax, or a sample from the warped q with
   the row's generator; the chain drafter's `draft_on_device`, chain_drafting.py);
3. one target forward verifies every row (the input ids assembled on the device);
4. the verdicts (the verifier's `chain_verdicts`, verifier.py: greedy for all greedy rows in a
   few batched operations, the rejection rule per sampled row) stay on the device;
5. one read brings back, per row, the accepted count, the next token and the drafted tokens
   with their scores; the trees, stops and stats are then made on the host as on the host path.

The tokens are those of the host path (the same draws from the same generators in the same
order), so a row's output does not depend on which path ran its step. A step with a row that
does not qualify runs the host path. `host_reads` counts what the step read back.
"""

from __future__ import annotations

import time

import torch

from inference.engine.batch.chain_drafting import DeviceChain
from inference.engine.decode.decoder import reseed_at
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.verify import VerifyResult
from inference.engine.drafters.base import DraftRequest
from inference.engine.kv.ragged import RowInput

# drafters whose drafts are chains of a length known before drafting (their tokens are the host's
# for n-gram and suffix, the device's for the draft model)
DEVICE_CHAIN_DRAFTERS = frozenset({"none", "draft_model", "ngram", "suffix"})


class DeviceStep:
    """The one-read decode step of the batched engine (a mixin; see the module docstring)."""

    host_reads = 0  # device-to-host reads of the last step that ran on the device

    def _device_step_possible(self) -> bool:
        """Whether this step qualifies (after `_choose_depth`, which says which rows the confidence
        scheduler runs: they decide from their drafts' values, on the host)."""
        if (self.scheduling and self.confidence.any_scheduled) or self.dspark is not None:
            return False
        for row in self.rows:
            if (row.matcher is not None or row.prefilling or not row.can_draft(self._chunk)
                    or row.drafter_kind not in DEVICE_CHAIN_DRAFTERS
                    or row.request.draft_config.confidence_threshold):
                return False
        return True

    def _device_step(self, policy_depth: int) -> tuple[list[DraftTree], list[VerifyResult], float]:
        """Draft and verify every row with one read (module docstring); the rows' trees, verdicts
        and the seconds drafting took."""
        started = time.perf_counter()
        self.host_reads = 0
        for row in self.rows:
            reseed_at(row.generator, row.config.seed, len(row.generated))
        depths = [self._row_depth(row, policy_depth) for row in self.rows]
        host_trees: dict[int, DraftTree] = {}
        for row, depth in zip(self.rows, depths):
            row.depth_choices[depth] = row.depth_choices.get(depth, 0) + 1
            if depth and row.drafter_kind in ("ngram", "suffix"):
                row_started = time.perf_counter()
                host_trees[id(row)] = row.drafter.propose(row.context, DraftRequest(depth, row.sampling, row.generator))
                self.policy.observe_row_draft(row.drafter_kind, depth, time.perf_counter() - row_started)
        wanted = {id(row): depth for row, depth in zip(self.rows, depths) if row.drafter_kind == "draft_model"}
        chains = (self.chain_drafter.draft_on_device(self.draft_cache, self.draft_rows, wanted, self.device,
                                                     self._observe_draft)
                  if any(wanted.values()) else {})
        draft_seconds = time.perf_counter() - started
        trees, results = self._verify_on_device(host_trees, chains)
        return trees, results, draft_seconds

    # -- verifying --------------------------------------------------------------------------

    def _verify_on_device(self, host_trees: dict[int, DraftTree], chains: dict[int, DeviceChain]
                          ) -> tuple[list[DraftTree], list[VerifyResult]]:
        rows = self.rows
        device = self.device
        lengths = []
        for row in rows:
            chain = chains.get(id(row))
            tree = host_trees.get(id(row))
            lengths.append(chain.tokens.shape[0] if chain is not None else len(tree) if tree is not None else 0)
        news = [len(self._context_new(row)) for row in rows]
        width = max(new + length for new, length in zip(news, lengths))
        inputs, host_ids = [], torch.zeros(len(rows), width, dtype=torch.long)
        for index, (row, new, length) in enumerate(zip(rows, news, lengths)):
            context_new = self._context_new(row)
            tree = host_trees.get(id(row))
            tokens = context_new + (tree.token_ids if tree is not None else [0] * length)
            host_ids[index, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            start = row.cached
            inputs.append(RowInput(tokens, list(range(start, start + new + length))))
        ids = host_ids.to(device)
        for index, row in enumerate(rows):
            chain = chains.get(id(row))
            if chain is not None and lengths[index]:
                ids[index, news[index]:news[index] + lengths[index]] = chain.tokens
        forward_started = time.perf_counter()
        self.target_cache.forward(inputs, device_ids=ids)
        self._log_forward("target", len(inputs), width, time.perf_counter() - forward_started)
        logits = self.target_cache.last_logits  # [rows, width, vocab]
        verdicts = self._verdicts(logits, news, lengths, host_trees, chains)
        # the step's one read: per row, accepted count, next token, drafted tokens and their scores
        packed = verdicts.tolist()
        self.host_reads += 1
        start = self.target_cache.last_start
        trees, results = [], []
        deepest = max(lengths, default=0)
        for index, (row, new, length) in enumerate(zip(rows, news, lengths)):
            accepted, next_token = int(packed[index][0]), int(packed[index][1])
            chain = chains.get(id(row))
            if chain is not None:
                tokens = [int(value) for value in packed[index][2:2 + length]]
                scores = packed[index][2 + deepest:2 + deepest + length]
                tree = DraftTree.chain(tokens, scores, chain.draft_probs)
                row.draft_extra = tokens[:-1] if length else []
            else:
                tree = host_trees.get(id(row), DraftTree.empty())
            if length > accepted:
                self.target_cache.drop(index, [start + new + node for node in range(accepted, length)])
            trees.append(tree)
            results.append(VerifyResult(list(range(accepted)), next_token))
        return trees, results

    def _verdicts(self, logits: torch.Tensor, news: list[int], lengths: list[int],
                  host_trees: dict[int, DraftTree], chains: dict[int, DeviceChain]) -> torch.Tensor:
        """[rows, 2 + 2 * deepest] float64 on the device: accepted count, next token, the drafted
        tokens and their scores (zero-padded), per row."""
        device = logits.device
        deepest = max(lengths, default=0)
        rows = self.rows
        drafts = torch.zeros(len(rows), deepest, dtype=torch.long, device=device)
        scores = torch.zeros(len(rows), deepest, dtype=torch.float64, device=device)
        draft_probs: list[torch.Tensor | None] = []
        for index, row in enumerate(rows):
            chain = chains.get(id(row))
            draft_probs.append(chain.draft_probs if chain is not None else None)
            if not lengths[index]:
                continue
            if chain is not None:
                drafts[index, :lengths[index]] = chain.tokens
                scores[index, :lengths[index]] = chain.log_probs.to(torch.float64)
            else:
                drafts[index, :lengths[index]] = torch.tensor(host_trees[id(row)].token_ids, device=device)
        # each row's verdict logits start after its last context token
        starts = [new - 1 for new in news]
        verdict = self.verifier.chain_verdicts(rows, logits, starts, lengths, drafts, draft_probs)
        return torch.cat((verdict.to(torch.float64), drafts.to(torch.float64), scores), dim=1)
