"""How often the target takes a draft node: learned online, per sibling rank and draft confidence.

A distilled draft is often flat: its top two candidates may both get q ~ 0.15 while the target
picks the first one 85% of the time and the second 10%. Ranking tree nodes by raw draft
log-probability then builds wide, shallow trees that waste the node budget. The tree drafter
ranks nodes by calibrated values instead: tables of hit rates per (sibling rank, draft
probability bucket), updated from every step's outcome. Each prior is worth a few trials per
cell, so a table is usable from the first step and converges to the pair's real behaviour
within a few prompts.

Two tables, because greedy and sampled verification accept differently:
- `AcceptanceCalibration` (greedy): the r-th best candidate of a node, of draft probability q,
  is the target's argmax with some rate. Every candidate of an expanded node on the path the
  target took is one trial, a hit when it is the token the target chose.
- `SiblingCalibration` (sampling): the r-th sibling drawn without replacement at a node whose
  draft distribution has top probability q_max is accepted by the recursive rejection, given
  that siblings 0..r-1 were rejected. The feature is known before the sibling is drawn, so the
  tree's shape never depends on the token it is about to draw (which would bias q).
"""

from __future__ import annotations

import torch


class _RateTable:
    """Hits / trials per (rank, bucket of a probability in [0, 1]) with a prior per cell."""

    def __init__(self, ranks: int, buckets: int, prior: torch.Tensor, prior_trials: float) -> None:
        self.ranks = ranks
        self.buckets = buckets
        # [ranks, buckets]
        self.trials = torch.full((ranks, buckets), prior_trials, dtype=torch.float64)
        self.hits = prior.expand(ranks, buckets) * prior_trials
        # rank marginals over what was observed (no prior), for nodes whose feature is unknown yet
        self.seen_trials = torch.zeros(ranks, dtype=torch.float64)
        self.seen_hits = torch.zeros(ranks, dtype=torch.float64)
        self._prior_marginal = self.hits.mean(dim=1) / prior_trials
        self._refresh()

    def _refresh(self) -> None:
        self.table = (self.hits / self.trials).clamp(1e-6, 1.0)

    def cells(
        self,
        # [rows, ranks] (or [rows]) probabilities in [0, 1]
        probs: torch.Tensor,
        # [ranks] or broadcastable
        ranks: torch.Tensor,
    ) -> torch.Tensor:
        buckets = (probs.double() * self.buckets).long().clamp_(0, self.buckets - 1)
        return ranks.clamp(max=self.ranks - 1) * self.buckets + buckets

    def record(self, cells: list[int], hits: list[bool], ranks: list[int]) -> None:
        if not cells:
            return
        hit = torch.tensor(hits, dtype=torch.float64)
        self.trials.view(-1).index_add_(0, torch.tensor(cells), torch.ones(len(cells), dtype=torch.float64))
        self.hits.view(-1).index_add_(0, torch.tensor(cells), hit)
        rank = torch.tensor(ranks).clamp(max=self.ranks - 1)
        self.seen_trials.index_add_(0, rank, torch.ones(len(ranks), dtype=torch.float64))
        self.seen_hits.index_add_(0, rank, hit)
        self._refresh()

    def marginal(self, prior_trials: float = 4.0) -> torch.Tensor:
        """[ranks] the rate of each rank over every observed feature, shrunk to the prior."""
        return ((self.seen_hits + self._prior_marginal * prior_trials)
                / (self.seen_trials + prior_trials)).clamp(1e-6, 1.0)

    def rates(self) -> list[list[float]]:
        return self.table.tolist()


class AcceptanceCalibration(_RateTable):
    """Greedy: P(the target's argmax is the r-th best candidate | its draft probability q)."""

    def __init__(self, ranks: int, buckets: int = 10, prior_trials: float = 2.0) -> None:
        centres = (torch.arange(buckets, dtype=torch.float64) + 0.5) / buckets
        super().__init__(ranks, buckets, centres, prior_trials)

    def log_value(
        self,
        # [rows, ranks] candidate probabilities, best first
        probs: torch.Tensor,
    ) -> torch.Tensor:
        """[rows, ranks] log P(the target picks this candidate)."""
        ranks = torch.arange(probs.shape[-1])
        return self.table.flatten().log()[self.cells(probs.cpu(), ranks)].to(probs.device)

    def observe(self, probs: list[float], hits: list[bool]) -> None:
        """Record one node's candidates (best first) and whether the target chose each."""
        if not probs:
            return
        ranks = list(range(len(probs)))
        cells = self.cells(torch.tensor([probs], dtype=torch.float64), torch.tensor(ranks))[0]
        self.record(cells.tolist(), hits, ranks)

    def mean_log_values(self) -> list[float]:
        """[ranks] log hit rate of each rank whatever its probability (a node not expanded yet)."""
        return _monotone(self.marginal()).log().tolist()


class SiblingCalibration(_RateTable):
    """Sampling: P(sibling r is accepted | siblings 0..r-1 rejected, the node's top q is q_max).

    The prior: the first sibling is accepted about as often as a well-distilled draft's token
    (0.5 + q_max / 2), later ones a third of that.
    """

    def __init__(self, ranks: int, buckets: int = 10, prior_trials: float = 2.0) -> None:
        centres = (torch.arange(buckets, dtype=torch.float64) + 0.5) / buckets
        first = 0.5 + centres / 2
        prior = torch.stack([first if rank == 0 else first / 3 for rank in range(ranks)])
        super().__init__(ranks, buckets, prior, prior_trials)

    def log_slot_values(self, top_probability: float) -> list[float]:
        """[ranks] log P(the r-th sibling drawn at this node is the one accepted), r = 0, 1, ...

        P(r accepted) = prod_{j<r} (1 - a_j) * a_r with a_j the conditional rates: the events
        are disjoint, so a node's children's values add up to its chance of extending the path.
        """
        ranks = torch.arange(self.ranks)
        rates = self.table.flatten()[self.cells(torch.tensor(float(top_probability)), ranks)]
        return _slot_values(rates).log().tolist()

    def mean_log_slot_values(self) -> list[float]:
        """The same for a node whose draft distribution is not known yet."""
        return _slot_values(self.marginal()).log().tolist()

    def observe(self, top_probability: float, tried: int, accepted_rank: int | None) -> None:
        """One node on the path: siblings 0..tried-1 were tested in order, `accepted_rank` won."""
        if tried <= 0:
            return
        ranks = list(range(tried))
        cells = self.cells(torch.tensor([float(top_probability)] * tried), torch.tensor(ranks))
        self.record(cells.tolist(), [rank == accepted_rank for rank in ranks], ranks)


def _slot_values(
    # [ranks] conditional acceptance rates
    rates: torch.Tensor,
) -> torch.Tensor:
    """[ranks] prod_{j<r} (1 - a_j) * a_r, made non-increasing (a later sibling never outranks)."""
    survive = torch.cat([torch.ones(1, dtype=rates.dtype), (1 - rates).cumprod(0)[:-1]])
    return _monotone((survive * rates).clamp_min(1e-9))


def _monotone(values: torch.Tensor) -> torch.Tensor:
    return values.cummin(dim=0).values
