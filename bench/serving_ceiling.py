"""What bench/serving.py's workload could reach with these forwards and nothing else: its ceiling.

The batched engine's throughput at c rows is bounded by its forwards: a speculative step of
depth k costs one target forward of c x (k + 1) tokens and k draft forwards of c rows, and
yields c x E(k) tokens, E(k) = 1 + sum_{d<=k} prod_{j<=d} a_j with a_j the conditional
acceptance at position j; every prompt is prefilled once (target and draft). Measuring those
forwards in the run (medians of alternated repeats, on a ragged cache of ~110 tokens a row, as
mid-generation) gives the time the workload would take with no Python between forwards, every
prompt prefilled c at a time and the best depth at every step, for c rows (and, for reference,
for the one-at-a-time decoder, gamma 4, a prompt at a time). The batch's ideal over the measured
tok/s of `sequential` and of `hf_static` bounds `batch8_over_sequential` and `ours_over_hf_batch8`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.matmul_kernels import forward_once

CACHED = 110  # tokens a row holds mid-generation (48-token prompt + ~64 generated, halfway)


@dataclass(frozen=True)
class Ceiling:
    sequential_tps: float
    batch_tps: float
    batch_depth: int
    step_ms: float

    @property
    def batch_over_sequential(self) -> float:
        return self.batch_tps / self.sequential_tps


def _forward_ms(model, rows: int, new: int, cached: int, logits: str, repeats: int) -> float:
    return statistics.median(forward_once(model, rows, new, cached, logits)[0] for _ in range(repeats)) * 1000


def expected_tokens(acceptance: list[float], depth: int) -> float:
    """Tokens one step yields with `depth` drafted positions (the target's own token included)."""
    expected, survive = 1.0, 1.0
    for position in range(depth):
        survive *= acceptance[min(position, len(acceptance) - 1)]
        expected += survive
    return expected


def serving_ceiling(target, draft, prompt_tokens: int, new_tokens: int, requests: int, rows: int,
                    acceptance: list[float], gamma: int = 4, max_depth: int = 6,
                    repeats: int = 5) -> Ceiling:
    """The ideal tok/s of the sequential decoder and of `rows` batched rows on this workload."""
    def target_ms(r, n, cached=CACHED, logits="all"):
        return _forward_ms(target, r, n, cached, logits, repeats)

    def draft_ms(r, n, cached=CACHED, logits="all"):
        return _forward_ms(draft, r, n, cached, logits, repeats)

    prefill_one = target_ms(1, prompt_tokens, 0, "last") + draft_ms(1, prompt_tokens, 0, "none")
    prefill_batch = target_ms(rows, prompt_tokens, 0, "last") + draft_ms(rows, prompt_tokens, 0, "none")
    # the one-at-a-time decoder: a (gamma + 1)-token verify, the first draft forward reads two tokens
    sequential_step = target_ms(1, gamma + 1) + draft_ms(1, 2) + (gamma - 1) * draft_ms(1, 1)
    sequential_s = requests * (prefill_one + new_tokens / expected_tokens(acceptance, gamma) * sequential_step) / 1000
    draft_first, draft_next = draft_ms(rows, 2), draft_ms(rows, 1)
    best = None
    for depth in range(max_depth + 1):
        step = target_ms(rows, depth + 1) + (draft_first + (depth - 1) * draft_next if depth else 0.0)
        rate = rows * expected_tokens(acceptance, depth) / step
        if best is None or rate > best[1]:
            best = (depth, rate, step)
    depth, rate, step = best
    batch_s = requests / rows * prefill_batch / 1000 + requests * new_tokens / rate / 1000
    total = requests * new_tokens
    return Ceiling(total / sequential_s, total / batch_s, depth, step)
