"""Settings of one generation and of a drafter, validated once at construction.

Frozen dataclasses, so a config can be shared between threads and used as a cache key by the
prediction cache. Validation raises `ConfigError` naming the field and the rule; it never uses
`assert`, which `python -O` would strip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inference.engine.errors import ConfigError

if TYPE_CHECKING:  # imported lazily below: the constraints package imports the decoders, which import this
    from inference.engine.constraints.spec import OutputConstraint


def _require(condition: bool, field_name: str, rule: str) -> None:
    if not condition:
        raise ConfigError(f"{field_name}: {rule}")


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate: length, sampling (temperature 0 = greedy), seed and stop conditions.

    `max_new_tokens` is clamped to the room left in the target's context (the generation then
    ends with finish_reason "length"); a prompt with no room at all raises PromptTooLongError.
    A stop string ends generation after the token that completes it; that token is kept, as
    Hugging Face `generate` does. An EOS token is kept too. `eos_token_id=None` (the default)
    means the model's own EOS, as `generate` does (the decoders call `resolve_eos`); `()` means
    no EOS at all. `constraint` (an `OutputConstraint`, None for free text) restricts every token
    to what a JSON grammar allows; the output then ends where the grammar completes.

    The defaults below are also a request's defaults in both APIs (``inference.api`` reads them
    from here, as ``GenerationConfig.max_new_tokens`` and so on); the bounds a request may ask for
    are ``inference.limits``.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    eos_token_id: int | Sequence[int] | None = None
    constraint: OutputConstraint | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
                 "max_new_tokens", "must be an integer >= 1")
        _require(self.temperature >= 0.0, "temperature", "must be >= 0 (0 means greedy)")
        _require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
                 "must be an integer >= 0 (0 disables top-k)")
        _require(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1] (1 disables top-p)")
        _require(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer or None")
        stops = tuple(self.stop_strings)
        _require(all(isinstance(s, str) and s for s in stops), "stop_strings",
                 "must be non-empty strings")
        object.__setattr__(self, "stop_strings", stops)
        eos = self.eos_token_id
        if eos is not None and not isinstance(eos, int):
            eos = tuple(eos)
            _require(all(isinstance(t, int) for t in eos), "eos_token_id",
                     "must be an integer, a sequence of integers, or None")
            object.__setattr__(self, "eos_token_id", eos)
        if self.constraint is not None:
            from inference.engine.constraints.spec import OutputConstraint

            _require(isinstance(self.constraint, OutputConstraint), "constraint",
                     "must be an OutputConstraint or None")

    @property
    def greedy(self) -> bool:
        """Temperature 0 selects the target's argmax; sampling settings are then ignored."""
        return self.temperature == 0.0

    @property
    def eos_token_ids(self) -> frozenset[int]:
        if self.eos_token_id is None:
            return frozenset()
        if isinstance(self.eos_token_id, int):
            return frozenset((self.eos_token_id,))
        return frozenset(self.eos_token_id)


@dataclass(frozen=True)
class DraftConfig:
    """How a drafter proposes tokens.

    length: chain draft length (gamma) to start with; adaptive: grow it by one after a fully
    accepted step and shrink it by one after a rejection, within [min_length, max_length];
    confidence_threshold: stop a chain early when the draft's top probability falls under it
    (0 disables). The tree drafter expands `tree_width` children per node, keeps the
    `tree_width` best nodes of each level (by estimated acceptance of their path), drafts
    `tree_depth` levels and verifies at most `node_budget` nodes. The n-gram drafter matches the
    last `ngram_size` down to `ngram_min_size` tokens of the context.
    """

    length: int = 4
    adaptive: bool = False
    min_length: int = 1
    max_length: int = 8
    confidence_threshold: float = 0.0
    tree_width: int = 2
    tree_depth: int = 4
    node_budget: int = 8
    ngram_size: int = 3
    ngram_min_size: int = 1

    def __post_init__(self) -> None:
        _require(self.length >= 1, "length", "must be >= 1")
        _require(1 <= self.min_length <= self.max_length, "min_length",
                 "must satisfy 1 <= min_length <= max_length")
        if self.adaptive:
            _require(self.min_length <= self.length <= self.max_length, "length",
                     "must lie in [min_length, max_length] when adaptive is on")
        _require(0.0 <= self.confidence_threshold < 1.0, "confidence_threshold",
                 "must be in [0, 1) (0 disables)")
        _require(self.tree_width >= 1, "tree_width", "must be >= 1")
        _require(self.tree_depth >= 1, "tree_depth", "must be >= 1")
        _require(self.node_budget >= 1, "node_budget", "must be >= 1")
        _require(1 <= self.ngram_min_size <= self.ngram_size, "ngram_min_size",
                 "must satisfy 1 <= ngram_min_size <= ngram_size")
