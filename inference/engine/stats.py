"""Per-generation counters, a plain dataclass kept apart from any metrics exporter."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """What one generation did: steps, drafted and accepted tokens, timings.

    mean_accepted_length counts the target's own token of each step (correction or bonus), so
    it is tokens per verification step before any stop cut, comparable with the bound
    E = (1 - a^(g+1)) / (1 - a). For a tree, `drafted` counts every node, and position d is
    "drafted" in a step whose tree reaches depth d and "accepted" when the path reached it.

    Two acceptance figures: acceptance_rate = accepted / drafted (what share of the drafted
    tokens were kept), and per_token_acceptance, the alpha of the formula above: the chance
    that a drafted position the target reached is accepted, accepted / (accepted + rejections).

    Confidence-scheduled verification (batch/confidence_schedule.py) adds, over the steps whose
    verification length the scheduler chose: verified_lengths[L], steps that verified L draft
    positions (0: the draft did not pay and none was verified); expected_accepted, the sum of
    the survival estimates of the verified positions, against scheduled_accepted, the positions
    those steps really accepted (survival_calibration = realised / expected: 1 when the
    estimates are calibrated, below 1 when they promise too much); cut_tokens, drafted nodes
    the scheduler left unverified.
    """

    prompt_tokens: int = 0
    # prompt (and resumed) tokens adopted from the prefix cache instead of prefilled
    cached_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    # steps that ended on a rejected draft position (not every drafted position was accepted)
    rejections: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    verified_lengths: list[int] = field(default_factory=list)
    scheduled_steps: int = 0
    expected_accepted: float = 0.0
    scheduled_accepted: int = 0
    cut_tokens: int = 0
    # times the row was taken out of a full batch for another group's row and resumed later
    # (batch/fair_admission.py)
    preemptions: int = 0

    def record_schedule(self, length: int, expected: float, accepted: int, cut: int) -> None:
        """Count one step whose verification length the scheduler chose: `length` positions
        verified, `expected` their summed survival estimates, `accepted` of them kept, `cut`
        drafted nodes left unverified."""
        self.scheduled_steps += 1
        self.expected_accepted += expected
        self.scheduled_accepted += accepted
        self.cut_tokens += cut
        if length >= len(self.verified_lengths):
            self.verified_lengths.extend([0] * (length + 1 - len(self.verified_lengths)))
        self.verified_lengths[length] += 1

    @property
    def survival_calibration(self) -> float:
        """Accepted over expected in scheduled steps (1.0: calibrated estimates; 0 when none)."""
        return self.scheduled_accepted / self.expected_accepted if self.expected_accepted > 0 else 0.0

    def record_step(self, drafted: int, depth: int, accepted: int) -> None:
        """Count one verification step whose draft had `drafted` nodes reaching `depth`."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += accepted < depth
        missing = depth - len(self.drafted_per_position)
        if missing > 0:
            self.drafted_per_position.extend([0] * missing)
            self.accepted_per_position.extend([0] * missing)
        for position in range(depth):
            self.drafted_per_position[position] += 1
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_token_acceptance(self) -> float:
        reached = self.accepted + self.rejections
        return self.accepted / reached if reached else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(position d accepted | drafted), d = 1, 2, ..."""
        return [accepted / drafted if drafted else 0.0
                for drafted, accepted in zip(self.drafted_per_position, self.accepted_per_position)]

    @property
    def prefill_tokens(self) -> int:
        """Prompt (and resumed) tokens the target prefilled: those not adopted from the prefix cache."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    def merge(self, other: GenerationStats) -> None:
        """Add another generation's counters (the bench sums over prompts)."""
        for name in ("prompt_tokens", "cached_tokens", "new_tokens", "steps", "drafted", "accepted", "rejections",
                     "draft_seconds", "verify_seconds", "total_seconds", "scheduled_steps",
                     "expected_accepted", "scheduled_accepted", "cut_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position),
                             (self.verified_lengths, other.verified_lengths)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for position, count in enumerate(theirs):
                mine[position] += count

    def to_dict(self) -> dict:
        """Counters and derived rates, JSON-ready."""
        data = asdict(self)
        data.update(
            acceptance_rate=self.acceptance_rate,
            per_token_acceptance=self.per_token_acceptance,
            mean_accepted_length=self.mean_accepted_length,
            acceptance_per_position=self.acceptance_per_position,
            tokens_per_second=self.tokens_per_second,
            survival_calibration=self.survival_calibration,
            prefill_tokens=self.prefill_tokens,
        )
        return data
