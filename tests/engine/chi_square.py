"""The goodness-of-fit check shared by the sampling tests (pure numpy/scipy)."""
from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def joint_p_value(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square p-value of observed ``counts`` against ``expected_probs``.

    Cells expected fewer than 5 times are pooled into one (the test's validity condition); a
    count in a cell of probability 0 is an outright failure (p = 0).
    """
    expected = expected_probs * counts.sum()
    keep = expected >= 5
    if counts[expected == 0].sum() > 0:
        return 0.0  # a pair the target never emits was emitted
    observed, pooled = counts[keep], expected[~keep].sum()
    if pooled > 0:
        observed = np.append(observed, counts[~keep].sum())
    expected = np.append(expected[keep], pooled) if pooled > 0 else expected[keep]
    return chisquare(observed, expected).pvalue
