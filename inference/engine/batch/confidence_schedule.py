"""Confidence-scheduled verification: how many draft tokens each row of a batch verifies.

DSpark's hardware-aware prefix scheduler (../shared/DESIGN.md, "DSpark"). Each row r has
drafted a chain (or a tree) with survival estimates a_{r,1} >= a_{r,2} >= ...: a_{r,j} is the
estimated probability that positions 1..j of the row's draft are all accepted, so verifying
them adds a_{r,j} expected tokens. The step starts with every row verifying 0 draft tokens
(each row still yields its own token: tau = R expected tokens at the cost of a forward of width
1) and admits (row, position) pairs in order of a_{r,j}, highest first, one at a time, while the
expected throughput tau / seconds(lengths) grows; it stops at the FIRST admission that would
lower it. A row's admitted positions are always a prefix of its draft: a_{r,j} never exceeds
a_{r,j-1} and ties go to the lower position, so (r, j) is reached only after (r, j - 1).

Why stop at the first drop and never look past it (the DSpark paper's Appendix A). Sampling
stays exact under speculative decoding only if the decision to verify position j is made
without looking at the draft token at j: the rejection rule accepts x_j ~ q with probability
min(1, p/q), and the emitted token follows p because x_j is an unconditioned draw from q. If
whether j is verified depended on x_j itself (a rule that verifies j "when its token looks
good"), the verified x_j is no longer a draw from q but from q conditioned on being verified,
and the emitted distribution is biased (tests/inference/engine/test_scheduler_lossless.py shows
the chi-square test failing). Every quantity this scheduler reads when it decides about (r, j)
is a pair it met before (r, j) in the order: pairs of higher or equal survival, whose estimates
depend on their own rows' earlier tokens only (never on x_{r,j}: see survival.py). A scheduler
that scanned the whole list for the best cut would decide about (r, j) from the later pairs
too, among them (r, j + 1), whose estimate depends on x_{r,j}: the decision about j would
look at j's own token. Stopping at the first drop makes the decision a stopping rule over the
candidates in order, hence non-anticipating and lossless; it costs little, since survival
only falls along a row.

The cost is whatever the forward will really cost for given lengths: `PackedForwardCost` for
a forward that packs rows' real tokens (DSpark's deployment, and this engine once its linear
layers take packed inputs), `PaddedForwardCost` for this engine's ragged cache today, which
pads every row of a forward to the widest: one extra token on the widest row widens every
row, one on a narrower row is free. Under padding the pair-by-pair rule degenerates: the first
pair that widens the forward must pay for every row's extra column alone (at 8 rows on this
CPU a verify column costs ~15 % of a step, so a pair of survival 0.9, +11 % tokens, never
does) and nothing is ever verified, although the whole level (every row's position j) would
pay. `schedule_levels` is the same first-drop rule with levels as the unit: at level j the
rows whose position j - 1 was admitted offer their pairs (r, j), most likely first, and the
level admits the best prefix of them (the one with the highest tau / seconds), if that beats
the schedule so far; the first level that does not ends the schedule. With a padded forward
every pair of a level rides in the width its first one pays for, so the level is admitted
whole; with a partly packed one (`PaddedForwardCost.packed_share`: the engine's
`pack_linear`, where the linear layers take real tokens only and attention stays padded) a
pair also costs its own compute and an unlikely one stays out. It is non-anticipating for
the same reason as the pair rule: the decision about (r, j) reads level j's estimates, which
depend on tokens before j only (its own row's and other rows'), never a later position of its
own row, and the stop after level j is decided from level j + 1's. `schedule` picks the rule
by the cost's kind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# seconds of one forward of `rows` rows by `tokens` tokens per row (the policy's cost models)
ForwardSeconds = Callable[[int, float], float]


@dataclass(frozen=True)
class Schedule:
    """The verification lengths chosen, and the throughput they were chosen for."""

    lengths: list[int]
    # tau: rows' own tokens plus the admitted positions' survival estimates
    expected_tokens: float
    seconds: float
    # per row: the sum of its admitted positions' survival estimates (its expected accepted drafts)
    expected_accepted: list[float] = field(default_factory=list)


def schedule_prefixes(survival: Sequence[Sequence[float]], seconds: Callable[[list[int]], float],
                      base_tokens: float | None = None) -> Schedule:
    """Per-row verification lengths (see the module docstring).

    survival: per row, a_{r,1..L_r}; a value above an earlier one of its row is read as the
    earlier one (a prefix cannot survive more often than its own prefix).
    seconds: the step's cost for given per-row lengths (a `PaddedForwardCost`, ...).
    base_tokens: tokens the step yields with no draft verified (default: one per row; pass
    more when rows outside `survival` share the forward).
    """
    rows = len(survival)
    lengths = [0] * rows
    expected_accepted = [0.0] * rows
    tokens = float(rows if base_tokens is None else base_tokens)
    cost = seconds(lengths)
    candidates = []
    for row, estimates in enumerate(survival):
        running = 1.0
        for position, estimate in enumerate(estimates, start=1):
            running = min(running, max(0.0, float(estimate)))
            candidates.append((-running, position, row))
    candidates.sort()  # survival descending; ties: lower position, then lower row
    for negative, position, row in candidates:
        estimate = -negative
        lengths[row] = position  # == previous length + 1: ties and the running min ensure it
        new_cost = seconds(lengths)
        # admit while tau / seconds grows, strictly (cross-multiplied: costs may be 0)
        if not (tokens + estimate) * cost > tokens * new_cost:
            lengths[row] = position - 1
            break  # the first drop ends the schedule: never look past it
        tokens += estimate
        expected_accepted[row] += estimate
        cost = new_cost
    return Schedule(lengths, tokens, cost, expected_accepted)


def schedule_levels(survival: Sequence[Sequence[float]], seconds: Callable[[list[int]], float],
                    base_tokens: float | None = None) -> Schedule:
    """Per-row verification lengths, a level at a time (see the module docstring): for a
    forward padded to its widest row, where only the width costs."""
    rows = len(survival)
    estimates = [_non_increasing(row) for row in survival]
    lengths = [0] * rows
    expected_accepted = [0.0] * rows
    tokens = float(rows if base_tokens is None else base_tokens)
    cost = seconds(lengths)
    for level in range(1, max((len(row) for row in estimates), default=0) + 1):
        # rows that reached the level, with a position there worth anything, most likely first
        joining = sorted((row for row in range(rows) if lengths[row] == level - 1
                          and len(estimates[row]) >= level and estimates[row][level - 1] > 0),
                         key=lambda row: (-estimates[row][level - 1], row))
        trial, gain = list(lengths), 0.0
        best, best_tokens, best_cost = 0, tokens, cost
        for count, row in enumerate(joining, start=1):
            trial[row] = level
            gain += estimates[row][level - 1]
            trial_cost = seconds(trial)
            # a better tau / seconds than the best so far (cross-multiplied: costs may be 0)
            if (tokens + gain) * best_cost > best_tokens * trial_cost:
                best, best_tokens, best_cost = count, tokens + gain, trial_cost
        if best == 0:
            break  # the first level that does not pay ends the schedule
        for row in joining[:best]:
            lengths[row] = level
            expected_accepted[row] += estimates[row][level - 1]
        tokens, cost = best_tokens, best_cost
    return Schedule(lengths, tokens, cost, expected_accepted)


def schedule(survival: Sequence[Sequence[float]], seconds: Callable[[list[int]], float],
             base_tokens: float | None = None) -> Schedule:
    """Level by level for a padded forward, pair by pair otherwise (module docstring)."""
    rule = schedule_levels if isinstance(seconds, PaddedForwardCost) else schedule_prefixes
    return rule(survival, seconds, base_tokens)


def _non_increasing(values: Sequence[float]) -> list[float]:
    result, running = [], 1.0
    for value in values:
        running = min(running, max(0.0, float(value)))
        result.append(running)
    return result


@dataclass(frozen=True)
class PaddedForwardCost:
    """A step whose forward pads every row to its widest row (this engine's ragged cache).

    rows: every row of the forward, scheduled or not. row_tokens[r][L]: tokens scheduled row r
    feeds when it verifies L draft positions (its pending token plus the draft's nodes of depth
    <= L: a tree level counts all its nodes). floor_width: the widest row outside the schedule
    (a prefill chunk, a seeded row's own draft). fixed_seconds: what the step costs whatever
    the lengths (the drafting planned, its Python overhead): counted, since the step's
    throughput is its tokens over all its time. packed_share: the share of a forward's time
    that takes real tokens only (the linear layers under the engine's `pack_linear`; 0: all of
    it padded), costed at the rows' mean real tokens, `other_tokens` being the real tokens of
    the rows outside the schedule.
    """

    forward_seconds: ForwardSeconds
    rows: int
    row_tokens: list[list[int]]
    floor_width: int = 1
    fixed_seconds: float = 0.0
    packed_share: float = 0.0
    other_tokens: int = 0

    def width(self, lengths: list[int]) -> int:
        return max([self.floor_width] + [tokens[length] for tokens, length in zip(self.row_tokens, lengths)])

    def __call__(self, lengths: list[int]) -> float:
        padded = self.forward_seconds(self.rows, self.width(lengths))
        if not self.packed_share:
            return self.fixed_seconds + padded
        total = self.other_tokens + sum(tokens[length] for tokens, length in zip(self.row_tokens, lengths))
        packed = self.forward_seconds(self.rows, total / max(self.rows, 1))
        return self.fixed_seconds + (1 - self.packed_share) * padded + self.packed_share * packed


@dataclass(frozen=True)
class PackedForwardCost:
    """A step whose forward feeds only the rows' real tokens (no padding): the cost of the
    packed tokens spread over the rows. other_tokens: the tokens of rows outside the schedule."""

    forward_seconds: ForwardSeconds
    rows: int
    row_tokens: list[list[int]]
    other_tokens: int = 0
    fixed_seconds: float = 0.0

    def __call__(self, lengths: list[int]) -> float:
        total = self.other_tokens + sum(tokens[length] for tokens, length in zip(self.row_tokens, lengths))
        return self.fixed_seconds + self.forward_seconds(self.rows, total / max(self.rows, 1))


def chain_tokens(depth: int, context_tokens: int = 1) -> list[int]:
    """row_tokens of a chain of `depth` drafts: its context tokens plus L drafts, L = 0..depth."""
    return [context_tokens + length for length in range(depth + 1)]
