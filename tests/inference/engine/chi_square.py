"""The goodness-of-fit check shared by the sampling tests (pure numpy/scipy)."""
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
