"""The batched engine's verifier/sampler: a forward's logits and each row's draft in, verdicts out.

`RowVerifier` is a component the engine holds (`engine.verifier`), with no reference back to it:
it runs no forward, touches no cache and commits nothing to a row. It reads, of each row, only
what `SampledRow` names: how the row samples, its generator and its grammar matcher. Its terms:

- a **verdict** (`VerifyResult`) is the accepted path of a row's draft tree and the one token
  the target adds after it: the correction after a rejection, or the bonus token when every
  drafted position passed;
- a greedy row accepts the drafted tokens that equal the target's argmax; a sampled row runs the
  rejection rule (decode/verify.py, decode/chain_verify.py) on the target's warped distribution
  with the row's own generator, so its tokens follow the target's distribution exactly and do
  not depend on its companions;
- a constrained row (structured output, constraints/) verifies the grammar's forced tokens
  instead of its draft when there are any (**forced**: always accepted), loses the draft nodes
  the grammar forbids, and has its logits masked to the grammar at every node (`constrain`).

Two paths share it. The host path (verification.py; prefill.py for a newcomer's first token)
verifies any tree, one row at a time (`verdict`); the device step (device_step.py) verifies the
unconstrained chains of every row in a few tensor operations that read nothing back
(`chain_verdicts`). A chain gets the same verdict, its draws included, from either: both run
the same rejection rule on the same warped distribution.

The forward is not the verifier's: which cache it runs on and what it commits to each row stay
with the engine (verification.py, device_step.py), as a rejection sampler takes a model
runner's logits and knows no cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from inference.engine.constraints.masking import mask_logits, prune_forbidden, subtree, with_forced_prefix
from inference.engine.constraints.matcher import GrammarMatcher
from inference.engine.decode.chain_verify import sampled_chain_verdict
from inference.engine.decode.decoder import MAX_FORCED_DRAFT
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.sampling import SamplingParams, warp_probs
from inference.engine.decode.verify import VerifyResult, verify_greedy, verify_sampling


class SampledRow(Protocol):
    """What the verifier reads of a row (a `BatchRow` is one)."""

    sampling: SamplingParams | None  # None: greedy
    generator: torch.Generator | None  # the row's own draws (None: torch's global generator)
    matcher: GrammarMatcher | None  # the row's grammar, at the end of its committed tokens


@dataclass(frozen=True)
class GrammarDraft:
    """What a constrained row verifies this step (`RowVerifier.constrain`)."""

    tree: DraftTree  # the grammar's forced tokens, or the draft less the nodes it forbids
    # [1 + nodes, vocab_size] bool: the tokens allowed after the context and after each node
    allowed: torch.Tensor
    forced: bool  # `tree` is the grammar's forced tokens, not the drafter's


class RowVerifier:
    """Turns a forward's logits and each row's draft into verdicts (see the module docstring)."""

    def constrain(self, matcher: GrammarMatcher, tree: DraftTree, room: int) -> GrammarDraft:
        """The tree a row under `matcher` verifies, from its draft `tree`, and its masks.

        `room`: the tokens the row may still emit (forced tokens past it are not verified)."""
        forced = matcher.forced_tokens(min(room, MAX_FORCED_DRAFT))
        if forced:
            tree = with_forced_prefix(forced, DraftTree.empty())
        allowed, valid = matcher.masks_along(tree)
        kept = prune_forbidden(tree, valid)
        if len(kept) < len(tree):
            tree, allowed = subtree(tree, kept), allowed[[0] + [node + 1 for node in kept]]
        return GrammarDraft(tree, allowed, bool(forced))

    def verdict(
        self,
        row: SampledRow,
        tree: DraftTree,
        # [1 + nodes, vocab_size]: after the last context token, then after each node
        logits: torch.Tensor,
        # [1 + nodes, vocab_size] bool, a constrained row's masks from `constrain` (None: the
        # matcher's masks along `tree`, as for an undrafted step)
        allowed: torch.Tensor | None = None,
    ) -> VerifyResult:
        """The row's verdict on `tree`: greedy, or the rejection rule with the row's generator."""
        if row.matcher is not None:
            if allowed is None:
                allowed = row.matcher.masks_along(tree)[0]
            logits = mask_logits(logits, allowed)
        if row.sampling is None:
            return verify_greedy(tree, logits.argmax(dim=-1).tolist())
        return verify_sampling(tree, _target_probs(logits, row.sampling), row.generator)

    def chain_verdicts(
        self,
        rows: Sequence[SampledRow],
        # [rows, width, vocab_size] a forward's logits, row i's at logits[i]
        logits: torch.Tensor,
        starts: Sequence[int],
        lengths: Sequence[int],
        # [rows, deepest] int64, row i's chain in drafts[i, :lengths[i]] (the rest ignored)
        drafts: torch.Tensor,
        # per row, [lengths[i], vocab_size] the distributions its chain was drawn from, or None
        # (greedy rows, and drafters that propose without a distribution: point masses)
        draft_probs: Sequence[torch.Tensor | None],
    ) -> torch.Tensor:
        """[rows, 2] int64 on the device: each row's accepted count and next token, read nowhere.

        Row i's verdict logits are logits[i, starts[i]:starts[i] + lengths[i] + 1] (after its last
        context token, then after each drafted one). Greedy rows are judged together; sampled rows
        one by one in row order, each with its generator, so the draws are those of `verdict` on
        the same chains. Unconstrained rows only: a grammar's masks are the host path's."""
        if any(row.matcher is not None for row in rows):
            raise ValueError("chain_verdicts: a constrained row verifies on the host (verdict)")
        device = logits.device
        deepest = drafts.shape[1]
        verdict = torch.zeros(len(rows), 2, dtype=torch.long, device=device)
        greedy = [index for index, row in enumerate(rows) if row.sampling is None]
        if greedy:
            # the target's argmax after the last context token and each drafted one, per greedy row
            offsets = torch.tensor([starts[index] for index in greedy], device=device)
            columns = (offsets[:, None] + torch.arange(deepest + 1, device=device)[None]).clamp(max=logits.shape[1] - 1)
            rows_index = torch.tensor(greedy, device=device)
            target = logits[rows_index].argmax(dim=-1).gather(1, columns)  # [greedy, deepest + 1]
            valid = torch.arange(deepest, device=device)[None] < torch.tensor([lengths[i] for i in greedy],
                                                                             device=device)[:, None]
            matched = ((drafts[rows_index] == target[:, :deepest]) & valid).to(torch.long)
            accepted = matched.cumprod(dim=1).sum(dim=1)
            verdict[rows_index] = torch.stack((accepted, target.gather(1, accepted[:, None])[:, 0]), dim=1)
        for index, row in enumerate(rows):
            if row.sampling is None:
                continue
            length, start = lengths[index], starts[index]
            target_probs = _target_probs(logits[index, start:start + length + 1], row.sampling)
            verdict[index] = sampled_chain_verdict(drafts[index, :length], target_probs, draft_probs[index],
                                                   row.generator)
        return verdict


def _target_probs(
    # [positions, vocab_size]
    logits: torch.Tensor,
    sampling: SamplingParams,
) -> torch.Tensor:
    """[positions, vocab_size] the target's warped distributions, in at least float32."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return warp_probs(logits, sampling)
