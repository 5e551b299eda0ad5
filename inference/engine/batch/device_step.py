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
   the row's generator);
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
from dataclasses import dataclass

import torch

from inference.engine.batch.rows import BatchRow
from inference.engine.decode.decoder import reseed_at
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.sampling import warp_probs
from inference.engine.decode.verify import VerifyResult
from inference.engine.drafters.base import DraftRequest
from inference.engine.kv.ragged import RowInput
from inference.engine.lm.modeling import align_vocab

# drafters whose drafts are chains of a length known before drafting (their tokens are the host's
# for n-gram and suffix, the device's for the draft model)
DEVICE_CHAIN_DRAFTERS = frozenset({"none", "draft_model", "ngram", "suffix"})


@dataclass
class DeviceChain:
    """A draft_model row's chain while it is on the device."""

    tokens: torch.Tensor  # [k] int64
    log_probs: torch.Tensor  # [k] the draft's log-probability of each token
    draft_probs: torch.Tensor | None  # [k, vocab] (sampled rows), None for greedy


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
        chains = self._draft_chains_on_device(wanted) if any(wanted.values()) else {}
        draft_seconds = time.perf_counter() - started
        trees, results = self._verify_on_device(host_trees, chains)
        return trees, results, draft_seconds

    # -- drafting ---------------------------------------------------------------------------

    def _draft_chains_on_device(self, wanted: dict[int, int]) -> dict[int, DeviceChain]:
        """The draft_model rows' chains, every drawn token fed to the next shared forward on the device."""
        cache = self.draft_cache
        inputs: list[RowInput] = []
        drafting: list[int] = []
        for index, row in enumerate(self.draft_rows):
            depth = wanted.get(id(row), 0)
            if depth == 0:
                inputs.append(RowInput([], []))  # the draft catches up when it next drafts
                continue
            common = row.draft_synced
            for token in row.draft_extra:
                if common < len(row.context) and row.context[common] == token:
                    common += 1
                else:
                    break
            common = min(common, len(row.context) - 1)  # its last context token's logits are needed
            cache.truncate_row(index, common)
            end = len(row.context)
            inputs.append(RowInput(self._draftable(row.context[common:end]), list(range(common, end))))
            row.draft_synced, row.draft_extra = end, []
            drafting.append(index)
        if not drafting:
            return {}
        forward_started = time.perf_counter()
        logits = cache.forward(inputs)
        self._observe_draft(inputs, forward_started)
        # [rows, vocab] each drafting row's logits for its next position
        current = {index: align_vocab(logits[index][-1:], self.vocab_width)[0] for index in drafting}
        drawn: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {i: [] for i in drafting}
        deepest = max(wanted[id(self.draft_rows[index])] for index in drafting)
        for position in range(deepest):
            feeding = []
            for index in drafting:
                row = self.draft_rows[index]
                if position >= wanted[id(row)]:
                    continue
                drawn[index].append(_draw(row, current[index]))
                if position + 1 < wanted[id(row)]:
                    feeding.append(index)
            if not feeding:
                break
            steps = [RowInput([], []) for _ in self.draft_rows]
            for index in feeding:
                at = len(self.draft_rows[index].context) + position
                steps[index] = RowInput([0], [at])  # the id comes from `ids`, on the device
            ids = torch.zeros(len(self.draft_rows), 1, dtype=torch.long, device=self.device)
            feed_index = torch.tensor(feeding, dtype=torch.long, device=ids.device)
            ids[feed_index, 0] = torch.stack([drawn[index][-1][0] for index in feeding])
            forward_started = time.perf_counter()
            logits = cache.forward(steps, device_ids=ids)
            self._observe_draft(steps, forward_started)
            for index in feeding:
                current[index] = align_vocab(logits[index], self.vocab_width)[0]
        chains = {}
        for index in drafting:
            row = self.draft_rows[index]
            tokens = torch.stack([token for token, _, _ in drawn[index]])
            scores = torch.stack([score for _, score, _ in drawn[index]])
            probs = torch.stack([q for _, _, q in drawn[index]]) if row.sampling is not None else None
            chains[id(row)] = DeviceChain(tokens, scores, probs)
        return chains

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


def _draw(row: BatchRow, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(token, its draft log-probability, q) drawn as the draft model drafter draws it, on the device."""
    if row.sampling is None:
        best, token = logits.log_softmax(dim=-1).max(dim=-1)
        return token, best, None
    q = warp_probs(logits[None], row.sampling)[0]
    token = torch.multinomial(q, 1, generator=row.generator)[0]
    return token, q[token].log(), q
