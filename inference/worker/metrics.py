"""Prometheus metrics of generations, fed from the engine's GenerationStats (a plain dataclass)."""
from __future__ import annotations

from prometheus_client import Counter, Histogram

GENERATION_SECONDS = Histogram(
    "specops_generation_seconds", "Wall time of one generation in the worker.", ["drafter", "status"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
GENERATION_TOKENS = Counter("specops_generation_tokens_total", "Tokens generated.", ["drafter"])
DRAFTED_TOKENS = Counter("specops_speculative_drafted_tokens_total", "Draft tokens proposed.", ["drafter"])
ACCEPTED_TOKENS = Counter("specops_speculative_accepted_tokens_total", "Draft tokens accepted.", ["drafter"])
ACCEPTANCE_RATE = Histogram(
    "specops_speculative_acceptance_rate", "Acceptance rate of one generation.", ["drafter"],
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
)


def observe_generation(drafter: str, status: str, seconds: float, stats: dict | None) -> None:
    """Record one finished generation; ``stats`` is GenerationStats.to_dict() or None on failure."""
    GENERATION_SECONDS.labels(drafter, status).observe(seconds)
    if not stats:
        return
    GENERATION_TOKENS.labels(drafter).inc(stats.get("new_tokens", 0))
    drafted = stats.get("drafted", 0)
    if drafted:
        DRAFTED_TOKENS.labels(drafter).inc(drafted)
        ACCEPTED_TOKENS.labels(drafter).inc(stats.get("accepted", 0))
        ACCEPTANCE_RATE.labels(drafter).observe(stats.get("accepted", 0) / drafted)
