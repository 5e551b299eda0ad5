"""The verifier/sampler (batch/verifier.py) on its own: no engine, no model, logits and drafts in.

`RowVerifier` reads, of a row, only its sampling, generator and grammar matcher. Here:
- the device step's verdicts (`chain_verdicts`: every row of a forward at once, read nowhere)
  are, row by row, the host path's (`verdict` on the same chain), the rejection rule's draws
  included: greedy and sampled rows, with and without the draft's distributions, top-k and
  top-p, chains of every length up to the widest and none;
- a constrained row's grammar: the forced tokens replace the draft, a forbidden node is cut
  with its subtree, and neither a greedy nor a sampled verdict leaves the grammar however the
  target's logits lean; `chain_verdicts` refuses a constrained row (its masks are the host's).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from inference.engine.batch.verifier import RowVerifier
from inference.engine.constraints import OutputConstraint, new_matcher
from inference.engine.constraints.matcher import GrammarMatcher
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.sampling import SamplingParams

from .constraint_models import VOCAB, json_tokenizer
from .test_constraints import SCHEMAS

SMALL_VOCAB = 11


@dataclass
class _Row:
    """All the verifier reads of a row."""

    sampling: SamplingParams | None
    generator: torch.Generator | None
    matcher: GrammarMatcher | None = None


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("seed", range(12))
def test_the_device_steps_verdicts_are_the_host_paths_row_by_row(seed):
    rnd = random.Random(seed)
    torch.manual_seed(seed)
    count = rnd.randint(1, 6)
    lengths = [rnd.randint(0, 4) for _ in range(count)]
    deepest = max(lengths)
    starts = [rnd.randint(0, 3) for _ in range(count)]
    width = max(start + length + 1 for start, length in zip(starts, lengths)) + rnd.randint(0, 2)
    # [rows, width, vocab]: sharp enough that greedy drafts of the argmax are often accepted
    logits = torch.randn(count, width, SMALL_VOCAB) * 3
    samplings = [None, SamplingParams(1.0), SamplingParams(0.7, top_k=4), SamplingParams(1.0, top_p=0.8)]
    sampling = [rnd.choice(samplings) for _ in range(count)]
    drafts = torch.zeros(count, deepest, dtype=torch.long)
    draft_probs: list[torch.Tensor | None] = []
    for index in range(count):
        length, start = lengths[index], starts[index]
        target = logits[index, start:start + length].argmax(dim=-1)
        drafted = torch.randint(0, SMALL_VOCAB, (length,))
        keep = rnd.randint(0, length)  # the target's own tokens for a prefix, then the drafter's
        drafted[:keep] = target[:keep]
        drafts[index, :length] = drafted
        with_q = sampling[index] is not None and rnd.random() < 0.5
        draft_probs.append(torch.softmax(torch.randn(length, SMALL_VOCAB), dim=-1) if with_q else None)
    verifier = RowVerifier()
    device_rows = [_Row(sampling[index], _generator(100 + index)) for index in range(count)]
    verdicts = verifier.chain_verdicts(device_rows, logits, starts, lengths, drafts, draft_probs).tolist()
    for index in range(count):
        length, start = lengths[index], starts[index]
        chain = DraftTree.chain(drafts[index, :length].tolist(), draft_probs=draft_probs[index])
        host = verifier.verdict(_Row(sampling[index], _generator(100 + index)), chain,
                                logits[index, start:start + length + 1])
        assert verdicts[index] == [len(host.accepted_nodes), host.next_token], index
        assert host.accepted_nodes == list(range(len(host.accepted_nodes)))


def _matcher(schema: str = "flat") -> GrammarMatcher:
    tokenizer = json_tokenizer()
    return new_matcher(tokenizer, VOCAB, OutputConstraint.json_schema(SCHEMAS[schema]), (tokenizer.eos_token_id,))


def test_the_grammars_forced_tokens_replace_the_draft():
    matcher = _matcher()
    forced = matcher.forced_tokens(8)
    assert forced  # the object's opening and its first key
    constrained = RowVerifier().constrain(matcher, DraftTree.chain([5, 6, 7]), room=2)
    assert constrained.forced and constrained.tree.token_ids == forced[:2]  # no more than the row's room
    assert constrained.allowed.shape == (3, VOCAB)
    assert matcher.forced_tokens(8) == forced  # the matcher is where it was


def test_a_forbidden_node_is_cut_with_its_subtree_and_no_verdict_leaves_the_grammar():
    matcher = _matcher()
    matcher.advance(matcher.forced_tokens(8))
    allowed_now = matcher.allowed().nonzero()[:, 0].tolist()
    forbidden = next(token for token in range(VOCAB) if token not in allowed_now)
    # roots: an allowed token and a forbidden one; the forbidden root has a child of its own
    tree = DraftTree([allowed_now[0], forbidden, allowed_now[0]], [-1, -1, 1], [0.0] * 3)
    verifier = RowVerifier()
    constrained = verifier.constrain(matcher, tree, room=10)
    assert not constrained.forced
    assert constrained.tree.token_ids == [allowed_now[0]] and constrained.allowed.shape == (2, VOCAB)
    leaning = torch.zeros(2, VOCAB)
    leaning[:, forbidden] = 50.0  # the target prefers the forbidden token everywhere
    for sampling in (None, SamplingParams(1.0)):
        for seed in range(5):
            row = _Row(sampling, _generator(seed), matcher)
            result = verifier.verdict(row, constrained.tree, leaning, constrained.allowed)
            emitted = [constrained.tree.token_ids[node] for node in result.accepted_nodes] + [result.next_token]
            assert forbidden not in emitted
            assert bool(constrained.allowed[len(result.accepted_nodes), result.next_token])
    # without masks handed in, the matcher's own masks along the tree (an undrafted step)
    result = verifier.verdict(_Row(None, None, matcher), DraftTree.empty(), leaning[:1])
    assert result.next_token in allowed_now


def test_chain_verdicts_refuse_a_constrained_row():
    rows = [_Row(None, None), _Row(None, None, _matcher())]
    with pytest.raises(ValueError, match="constrained row"):
        RowVerifier().chain_verdicts(rows, torch.zeros(2, 1, VOCAB), [0, 0], [0, 0],
                                     torch.zeros(2, 0, dtype=torch.long), [None, None])
