"""How often the target picks the draft's r-th candidate given probability q: learned online.

A distilled draft is often flat: its top two candidates may both get q ~ 0.15 while the target
picks the first one 85% of the time and the second 10%. Ranking tree nodes by raw draft
log-probability then builds wide, shallow trees that waste the node budget. The tree drafter
ranks nodes by calibrated values instead: a table of hit rates per (candidate rank, probability
bucket), updated from every step's outcome (for each expanded node on the path the target
took, each of its candidate children is one trial, a hit when it is the token the target
chose). The prior is "the draft is calibrated", worth a few trials per cell, so the table is
usable from the first step and converges to the pair's real behaviour within a few prompts.
"""

from __future__ import annotations

import torch


class AcceptanceCalibration:
    """Hit rates per (rank among a node's candidates, draft-probability bucket)."""

    def __init__(self, ranks: int, buckets: int = 10, prior_trials: float = 2.0) -> None:
        self.ranks = ranks
        self.buckets = buckets
        centres = (torch.arange(buckets, dtype=torch.float64) + 0.5) / buckets
        self.trials = torch.full((ranks, buckets), prior_trials, dtype=torch.float64)
        self.hits = centres.expand(ranks, buckets) * prior_trials
        self._log_rates = self._compute_log_rates()

    def _compute_log_rates(self) -> torch.Tensor:
        return (self.hits / self.trials).clamp_min(1e-6).log()

    def _cells(
        self,
        # [rows, ranks] candidate probabilities, best first
        probs: torch.Tensor,
    ) -> torch.Tensor:
        buckets = (probs.double() * self.buckets).long().clamp_(0, self.buckets - 1)
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        return ranks * self.buckets + buckets

    def log_value(
        self,
        # [rows, ranks] candidate probabilities, best first
        probs: torch.Tensor,
    ) -> torch.Tensor:
        """[rows, ranks] log P(the target picks this candidate)."""
        table = self._log_rates.to(probs.device).flatten()
        return table[self._cells(probs)]

    def observe(self, probs: list[float], hits: list[bool]) -> None:
        """Record one node's candidates (best first) and whether the target chose each."""
        if not probs:
            return
        cells = self._cells(torch.tensor([probs], dtype=torch.float64))[0]
        self.trials.view(-1).index_add_(0, cells, torch.ones(len(probs), dtype=torch.float64))
        self.hits.view(-1).index_add_(0, cells, torch.tensor(hits, dtype=torch.float64))
        self._log_rates = self._compute_log_rates()

    def rates(self) -> list[list[float]]:
        return (self.hits / self.trials).tolist()
