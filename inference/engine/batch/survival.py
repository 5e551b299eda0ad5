"""Survival estimates per drafted position: what the verification scheduler admits by.

a_j = P(positions 1..j of a row's draft are all accepted), per row and step, from the best
source the row's drafter offers:
1. the draft's own per-node estimates (`DraftTree.survival`: a DSpark confidence head, or any
   drafter that carries them): a tree level's survival is the sum over its nodes (the paths
   are disjoint events);
2. `draft_model` chains: the draft model's probabilities, calibrated. Position j's confidence
   c_j is the rate at which the target has taken a chain token drafted from a distribution of
   top probability q_max(j), learned online per bucket of q_max (`ChainCalibration`, one table
   for greedy and one for sampled rows), and a_j = prod_{i<=j} c_i;
3. any other drafter (ngram, suffix, tree without its own estimates): the policy's running
   acceptance per position for that drafter (policy.py's `AcceptanceTracker`).

Losslessness needs a_j to be known before the token at j is: it may depend on the tokens
before j, never on x_j (confidence_schedule.py says why). q_max(j) is a property of the
distribution x_j is drawn from, fixed before the draw; q(x_j), the probability of the drawn
token, is not, and under sampling would let the decision look at x_j: it is never used. (Under
greedy drafting the two coincide: x_j is the argmax.) The tables learn only from past steps.
"""

from __future__ import annotations

import math

from inference.engine.batch.policy import SpeculationPolicy
from inference.engine.decode.draft_tree import DraftTree

# q buckets of the chain calibration tables (as the tree drafter's)
BUCKETS = 10


class ChainCalibration:
    """P(the target takes a chain token | the top probability q of its draft distribution).

    Per bucket of q, hits over trials, each bucket's prior being the rate over every bucket
    (itself shrunk to `prior`, the policy's prior for the drafter: a drafter starts out assumed
    useful, so it gets verified and measured). So the estimate is useful from the first steps
    (a draft whose q is flat but whose argmax is always the target's, or a sharp one that is
    often wrong, is corrected overall within a few verified positions) and follows q where the
    buckets' own trials say q matters. (Taking q at its word at first, as the tree drafter's
    tables do, left a flat draft that agreed with its target on every token verifying a
    fraction of its steps: its q of a few per cent never paid for a verify column, so it was
    rarely verified and slow to learn.)
    """

    def __init__(self, prior: float, buckets: int = BUCKETS, cell_prior: float = 2.0,
                 marginal_prior: float = 4.0) -> None:
        self.prior = prior
        self.buckets = buckets
        self.cell_prior = cell_prior
        self.marginal_prior = marginal_prior
        self.hits = [0.0] * buckets
        self.trials = [0.0] * buckets

    def _bucket(self, q: float) -> int:
        return min(self.buckets - 1, max(0, int(q * self.buckets)))

    @property
    def marginal(self) -> float:
        """The hit rate over every q, shrunk to the prior."""
        return ((sum(self.hits) + self.marginal_prior * self.prior)
                / (sum(self.trials) + self.marginal_prior))

    def rate(self, q: float) -> float:
        bucket = self._bucket(q)
        return (self.hits[bucket] + self.cell_prior * self.marginal) / (self.trials[bucket] + self.cell_prior)

    def observe(self, q: float, hit: bool) -> None:
        bucket = self._bucket(q)
        self.trials[bucket] += 1.0
        self.hits[bucket] += float(hit)


class SurvivalEstimates:
    """Per-position survival of a row's draft, and the calibration learned from verified steps."""

    def __init__(self, policy: SpeculationPolicy) -> None:
        self.policy = policy
        # draft_model chains: P(the target takes a chain token | q_max of its distribution)
        self.greedy_chain = ChainCalibration(policy.tracker("draft_model").prior)
        self.sampled_chain = ChainCalibration(policy.tracker("draft_model", sampled=True).prior)

    def confidence(self, top_probability: float, sampled: bool) -> float:
        """c for one chain position whose draft distribution has top probability q_max."""
        return (self.sampled_chain if sampled else self.greedy_chain).rate(top_probability)

    def expected_confidence(self, sampled: bool) -> float:
        """c for a chain position whose draft distribution is not known yet (over every q)."""
        return (self.sampled_chain if sampled else self.greedy_chain).marginal

    def confidences(self, top_probabilities: list[float], sampled: bool) -> list[float]:
        """c per chain position from the q_max of each position's draft distribution."""
        table = self.sampled_chain if sampled else self.greedy_chain
        return [table.rate(top) for top in top_probabilities]

    def of_tree(self, drafter: str, tree: DraftTree, sampled: bool) -> list[float]:
        """a_1..a_D for the tree's depths 1..D (see the module docstring for the sources)."""
        depth = tree.max_depth
        if depth == 0:
            return []
        if tree.survival is not None:
            per_depth = [0.0] * depth
            for node, value in enumerate(tree.survival):
                per_depth[tree.depths[node] - 1] += value
            return _non_increasing(per_depth)
        if drafter == "draft_model" and tree.is_chain:
            return _running_product(self.confidences(top_probabilities(tree), sampled))
        tracker = self.policy.tracker(drafter, sampled)
        return _running_product([tracker.rate(position) for position in range(depth)])

    def observe(self, drafter: str, tree: DraftTree, sampled: bool, accepted: int) -> None:
        """Teach the chain tables what a verified draft_model chain did (`accepted` of its
        `len(tree)` positions; positions after the first rejection were not reached)."""
        if drafter != "draft_model" or not tree.is_chain or tree.survival is not None or not len(tree):
            return
        for position, top in enumerate(top_probabilities(tree)[:accepted + 1]):
            (self.sampled_chain if sampled else self.greedy_chain).observe(top, position < accepted)


def top_probabilities(tree: DraftTree) -> list[float]:
    """q_max of each chain node's draft distribution (its row of draft_probs; under greedy
    drafting, where draft_probs is None, the node's log-probability is the top one's)."""
    if tree.draft_probs is not None:
        return tree.draft_probs.max(dim=-1).values.double().tolist()
    return [math.exp(value) for value in tree.log_probs]


def _running_product(confidences: list[float]) -> list[float]:
    survival, running = [], 1.0
    for confidence in confidences:
        running *= min(1.0, max(0.0, confidence))
        survival.append(running)
    return survival


def _non_increasing(values: list[float]) -> list[float]:
    result, running = [], 1.0
    for value in values:
        running = min(running, max(0.0, value))
        result.append(running)
    return result
