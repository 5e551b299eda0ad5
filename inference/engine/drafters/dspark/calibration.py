"""Sequential temperature scaling of DSpark's confidence head, on held-out text.

The scheduler reads survival a_k = ∏_{i≤k} σ(logit_i / T_i) (drafter.py `survival_estimates`):
the chance that positions 1..k all survive. A head trained towards the per-step acceptance
rate can still be over- or under-confident once its errors compound along the product, so one
temperature per position is fitted after training, left to right: T_1 on a_1 alone, then T_2
with T_1 fixed, and so on, each minimising the negative log-likelihood of a_k against what was
realised on held-out blocks — the running product of the exact per-step acceptance rates
1 − TV (training_forward.py), or of greedy hits (0/1) when that is what is passed. The
likelihood, not the binned calibration error (ECE) itself: ECE is flat and noisy where a_k is
small (late positions), and a grid search on it wanders there; the likelihood is a proper
score, so its minimum is the calibrated temperature, and ECE (`per_position_ece`) is what the
report measures. T = 1 is always a candidate, and ties go to the temperature nearest 1; a
temperature that lowers the likelihood by less than `MIN_GAIN` (relative) over T = 1 is not
taken: on a few hundred held-out blocks a head that is already calibrated would otherwise move
by noise, and its calibration on new text could only get worse.
"""

from __future__ import annotations

import math

import torch

#: The relative improvement of the likelihood over T = 1 a fitted temperature must bring.
MIN_GAIN = 0.005
#: Candidate temperatures: geometric from 1/4 to 8, with 1 exactly among them.
TEMPERATURE_GRID = tuple(sorted({round(2.0 ** (e / 8), 6) for e in range(-16, 25)}))


def running_survival(confidence_logits: torch.Tensor, temperatures: list[float] | None = None) -> torch.Tensor:
    """[..., γ] → [..., γ]: ∏_{i≤k} σ(logit_i / T_i) (T = 1 without temperatures)."""
    gamma = confidence_logits.shape[-1]
    scale = torch.tensor(temperatures if temperatures else [1.0] * gamma, dtype=torch.float64)
    return torch.sigmoid(confidence_logits.double() / scale).cumprod(dim=-1)


def expected_calibration_error(predicted: torch.Tensor, realised: torch.Tensor, bins: int = 10) -> float:
    """Σ_bins (share of samples) · |mean predicted − mean realised|, equal-width bins on [0, 1]."""
    predicted, realised = predicted.double().flatten(), realised.double().flatten()
    if predicted.numel() == 0:
        return 0.0
    index = (predicted * bins).long().clamp_(0, bins - 1)
    count = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, torch.ones_like(predicted))
    gap = (torch.zeros(bins, dtype=torch.float64).index_add_(0, index, predicted)
           - torch.zeros(bins, dtype=torch.float64).index_add_(0, index, realised))
    return float(gap.abs().sum() / predicted.numel())


def per_position_ece(confidence_logits: torch.Tensor, accept: torch.Tensor, valid: torch.Tensor,
                     temperatures: list[float] | None = None) -> list[float]:
    """ECE of the running survival at each position k over the blocks whose k-th label exists.

    confidence_logits, accept, valid: [blocks, γ]; `accept` is the per-step event (1 − TV, or a
    greedy hit), so the realised survival is its running product.
    """
    survival = running_survival(confidence_logits, temperatures)
    realised = accept.double().cumprod(dim=-1)
    return [expected_calibration_error(survival[valid[:, k], k], realised[valid[:, k], k])
            for k in range(confidence_logits.shape[-1])]


def fit_temperatures(confidence_logits: torch.Tensor, accept: torch.Tensor, valid: torch.Tensor,
                     grid: tuple[float, ...] = TEMPERATURE_GRID, min_gain: float = MIN_GAIN) -> list[float]:
    """One temperature per position, fitted left to right with the earlier ones fixed."""
    logits, valid = confidence_logits.double(), valid.bool()
    realised = accept.double().cumprod(dim=-1)
    prefix = torch.ones(logits.shape[0], dtype=torch.float64)  # ∏_{i<k} σ(logit_i / T_i)
    temperatures: list[float] = []
    for k in range(logits.shape[-1]):
        rows = valid[:, k]
        unscaled = _nll(prefix[rows] * torch.sigmoid(logits[rows, k]), realised[rows, k])
        best = (unscaled, 0.0, 1.0)  # (error, distance from T = 1, T)
        for temperature in grid:
            survival = prefix[rows] * torch.sigmoid(logits[rows, k] / temperature)
            error = _nll(survival, realised[rows, k])
            candidate = (round(error, 12), abs(math.log(temperature)), temperature)
            best = min(best, candidate)
        chosen = best[2] if best[0] < unscaled * (1.0 - min_gain) else 1.0
        temperatures.append(chosen)
        prefix = prefix * torch.sigmoid(logits[:, k] / chosen)
    return temperatures


def _nll(predicted: torch.Tensor, realised: torch.Tensor) -> float:
    """Mean binary cross-entropy of probabilities against (possibly soft) outcomes."""
    if predicted.numel() == 0:
        return 0.0
    p = predicted.clamp(1e-9, 1 - 1e-9)
    return float(-(realised * p.log() + (1 - realised) * (1 - p).log()).mean())
