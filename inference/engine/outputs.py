"""What a generation returns: one StepOutput per verification step, and the final result."""

from __future__ import annotations

from dataclasses import dataclass, field

from inference.engine.stats import GenerationStats


@dataclass(frozen=True)
class Branch:
    """One root-to-leaf path of a draft, kept as an n-best candidate by the metadata store."""

    token_ids: tuple[int, ...]
    # sum of the draft's log-probabilities along the branch (0.0 for model-free drafters)
    score: float
    # how many of the branch's leading tokens the target accepted
    accepted_len: int


@dataclass(frozen=True)
class StepOutput:
    """The tokens one verification step appended, after any cut at EOS, a stop string or the limit."""

    token_ids: list[int]
    drafted: int
    accepted: int
    branches: list[Branch] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
