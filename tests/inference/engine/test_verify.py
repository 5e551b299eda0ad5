"""The rejection sampler alone, on hand-made distributions: greedy walks and lossless sampling.

The sampling tests draw trees exactly as the DraftTree contract says (siblings without
replacement from q, or deterministic proposals), run the verifier many times and compare the
joint distribution of the first two emitted tokens with the target's by a chi-square test.
Seeds are fixed, so the p-values are fixed numbers; the threshold 0.001 is what a correct
sampler must pass, and a deliberately wrong q (a negative control) must fail it by far.
"""

from __future__ import annotations

import numpy as np
import torch

from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.verify import verify_greedy, verify_sampling

from .chi_square import joint_p_value

VOCAB = 5
RUNS = 12000
P_VALUE_FLOOR = 1e-3


def test_greedy_follows_matching_children_down_the_tree():
    #      roots: 0 (tok 7)        1 (tok 8)
    #               |               |
    #             2 (tok 3)       3 (tok 4) -> 4 (tok 5)
    tree = DraftTree([7, 8, 3, 4, 5], [-1, -1, 0, 1, 3], [0.0] * 5)
    # row 0: argmax after the context; row 1 + i: argmax after node i
    target = [8, 0, 4, 0, 5, 6]
    result = verify_greedy(tree, target)
    assert result.accepted_nodes == [1, 3, 4]
    assert result.next_token == 6
    # a different argmax at the root picks the other branch and stops under it
    result = verify_greedy(tree, [7, 1, 4, 0, 5, 6])
    assert result.accepted_nodes == [0]
    assert result.next_token == 1


def test_greedy_rejection_returns_the_target_token():
    tree = DraftTree.chain([4, 5, 6])
    result = verify_greedy(tree, [4, 5, 9, 1])
    assert result.accepted_nodes == [0, 1]
    assert result.next_token == 9
    assert verify_greedy(tree, [2, 5, 6, 1]).accepted_nodes == []
    assert verify_greedy(tree, [4, 5, 6, 1]).next_token == 1


def _random_distributions(generator: torch.Generator, rows: int) -> torch.Tensor:
    logits = 1.5 * torch.randn(rows, VOCAB, generator=generator, dtype=torch.float64)
    return logits.softmax(dim=-1)


class _ToyPair:
    """A two-token 'language': p(x1), p(x2 | x1) for the target, q likewise for the draft."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.p_first = _random_distributions(generator, 1)[0]
        self.p_second = _random_distributions(generator, VOCAB)
        self.q_first = _random_distributions(generator, 1)[0]
        self.q_second = _random_distributions(generator, VOCAB)

    def expected_joint(self) -> np.ndarray:
        return (self.p_first[:, None] * self.p_second).numpy().ravel()

    def target_rows(self, tree: DraftTree) -> torch.Tensor:
        """Row 0: after the context; row 1 + i: after node i (depth 1 nodes only matter)."""
        rows = [self.p_first] + [self.p_second[token] for token in tree.token_ids]
        return torch.stack(rows)


def _siblings_without_replacement(
    # [vocab_size]
    probs: torch.Tensor,
    count: int,
    generator: torch.Generator | None,
) -> list[int]:
    """Draw up to `count` distinct tokens, ordered as successive draws without replacement.

    The siblings of a sampled tree as the DraftTree contract says (no drafter draws them this
    way; the test builds its trees with it). Gumbel-top-k: the tokens sorted by log p + Gumbel noise are distributed as drawing one
    token, removing it, renormalising and drawing again. The order matters: recursive rejection
    sampling over siblings assumes sibling i was drawn from q with siblings 0..i-1 removed.
    """
    support = int((probs > 0).sum())
    count = min(count, support)
    uniform = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=probs.dtype)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(probs.dtype).tiny)))
    keys = probs.log() + gumbel
    return torch.topk(keys, count).indices.tolist()


def _sampled_tree(pair: _ToyPair, width: int, generator: torch.Generator,
                  claimed_q: torch.Tensor | None = None) -> DraftTree:
    roots = _siblings_without_replacement(pair.q_first, width, generator)
    tokens, parents, rows = [], [], []
    for token in roots:
        tokens.append(token), parents.append(-1)
        rows.append(pair.q_first if claimed_q is None else claimed_q)
    for root in range(len(roots)):
        q = pair.q_second[tokens[root]]
        tokens.append(int(torch.multinomial(q, 1, generator=generator)))
        parents.append(root)
        rows.append(q)
    return DraftTree(tokens, parents, [0.0] * len(tokens), torch.stack(rows))


def _first_two(pair: _ToyPair, tree: DraftTree, generator: torch.Generator) -> tuple[int, int]:
    result = verify_sampling(tree, pair.target_rows(tree), generator)
    emitted = [tree.token_ids[node] for node in result.accepted_nodes] + [result.next_token]
    if len(emitted) == 1:
        # the next step starts from p(. | x1), as the decoder's next verification does
        emitted.append(int(torch.multinomial(pair.p_second[emitted[0]], 1, generator=generator)))
    return emitted[0], emitted[1]


def _p_value(pair: _ToyPair, draw_tree) -> float:
    generator = torch.Generator().manual_seed(1234)
    counts = np.zeros(VOCAB * VOCAB)
    for _ in range(RUNS):
        first, second = _first_two(pair, draw_tree(generator), generator)
        counts[first * VOCAB + second] += 1
    return joint_p_value(counts, pair.expected_joint())


def test_recursive_rejection_over_sampled_siblings_is_lossless():
    pair = _ToyPair(seed=7)
    assert _p_value(pair, lambda g: _sampled_tree(pair, 3, g)) > P_VALUE_FLOOR


def test_chain_rejection_sampling_is_lossless():
    pair = _ToyPair(seed=8)
    assert _p_value(pair, lambda g: _sampled_tree(pair, 1, g)) > P_VALUE_FLOOR


def test_deterministic_sibling_proposals_are_lossless():
    pair = _ToyPair(seed=9)
    top_two = torch.topk(pair.q_first, 2).indices.tolist()

    def draw(generator):
        children = [int(torch.argmax(pair.q_second[token])) for token in top_two]
        return DraftTree(top_two + children, [-1, -1, 0, 1], [0.0] * 4)

    assert _p_value(pair, draw) > P_VALUE_FLOOR


def test_a_wrong_draft_distribution_is_detected():
    """Negative control: claim q is uniform while drawing from a skewed q; the test must fail."""
    pair = _ToyPair(seed=7)
    uniform = torch.full((VOCAB,), 1.0 / VOCAB, dtype=torch.float64)
    assert _p_value(pair, lambda g: _sampled_tree(pair, 2, g, claimed_q=uniform)) < 1e-6
