"""The goodness-of-fit check shared by the sampling tests (pure numpy/scipy).

How many runs a test needs: its power. A decoder whose emitted distribution q differs from the
target's p by Cohen's effect size w = sqrt(sum((q - p)^2 / p)) gives, over N runs, a chi-square
statistic with non-centrality N * w^2; the test must reject it (p < 1e-3) with power 0.99
(`detectable_effect` below). The deviation to catch is the classic lossless-sampling bug: a
rejected draft replaced by a sample of the target p rather than of the residual
norm(max(p - q_draft, 0)); its first-token marginal alone deviates by w = 0.38 for the
8-token llama pair at T = 1 (0.44 warped) and 0.27 for the grammar-masked pair, and the joint
deviates at least as much (merging cells never raises w). Accepting every draft (the negative
control: the draft's own distribution) is w > 2.
"""
from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def joint_p_value(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square p-value of observed ``counts`` against ``expected_probs``.

    Cells expected fewer than 5 times are pooled into one (the test's validity condition); a
    count in a cell of probability 0 is an outright failure (p = 0).
    """
    # normalised first: float32 probabilities sum to 1 only within ~1e-7, and scipy refuses
    # expected and observed totals that differ by more than 1e-8 (relative)
    expected = expected_probs / expected_probs.sum() * counts.sum()
    keep = expected >= 5
    if counts[expected == 0].sum() > 0:
        return 0.0  # a pair the target never emits was emitted
    observed, pooled = counts[keep], expected[~keep].sum()
    if pooled > 0:
        observed = np.append(observed, counts[~keep].sum())
    expected = np.append(expected[keep], pooled) if pooled > 0 else expected[keep]
    return chisquare(observed, expected).pvalue


def exact_joint(model, prompt: list[int], vocab: int, params) -> np.ndarray:
    """The target's exact joint distribution of the first two tokens after `prompt`, flattened
    [vocab * vocab] (1 + vocab forwards), after the same warping the decoder applies."""
    import torch

    from inference.engine.decode.sampling import warp_probs

    with torch.inference_mode():
        first = warp_probs(model(torch.tensor([prompt])).logits[0, -1:], params)[0]
        batch = torch.tensor([prompt + [token] for token in range(vocab)])
        second = warp_probs(model(batch).logits[:, -1], params)
    return (first[:, None] * second).double().numpy().ravel()


def detectable_effect(runs: int, cells: int, alpha: float = 1e-3, power: float = 0.99) -> float:
    """The smallest effect size w that `runs` draws over `cells` (after pooling) reject at
    `alpha` with probability `power`."""
    from scipy.optimize import brentq
    from scipy.stats import chi2, ncx2

    df, critical = cells - 1, chi2.isf(alpha, cells - 1)
    noncentrality = brentq(lambda nc: ncx2.sf(critical, df, nc) - power, 1e-9, 1e4)
    return float(np.sqrt(noncentrality / runs))
