"""How far to speculate at each step of a batch, from measured costs and running acceptance.

Speculation pays when the tokens a step is expected to yield grow faster than its cost. On a
lone sequence a target forward over five tokens costs little more than over one, so drafting
wins; in a large batch the forward is compute-bound and every drafted token costs almost as
much as a real one, so drafting deep loses (the top complaint of vLLM, SGLang and TGI users is
exactly this). The policy therefore picks, per step, the draft depth k (0 = no speculation)
that maximises

    throughput(k) = sum over rows of E_r(k)
                    / (target_cost(rows, k + 1) + draft_cost(k) + step_overhead(rows, k + 1))

where E_r(k) = 1 + sum_{d<=k} prod_{j<=d} a_j is a row's expected tokens per step with a_j its
drafter's running conditional acceptance at position j, and the costs come from models of
forward time (and of the step's time beyond its forwards) fitted online to the steps the batch
actually ran (and, in an engine, from a table of warm forwards profiled when it starts:
profiling.py); an untried width is assumed cheap until measured, so it gets tried. A policy
that keeps choosing 0 drafts anyway once in a while (`explore_after`): otherwise a cost or an
acceptance misjudged once is never measured again, and the policy can sit at "don't draft" for
good (issue 25: a fresh worker's first generations ran 95 of 96 steps undrafted).
Terms used below: "depth" is how many positions are drafted; "acceptance at position j" is the
chance that position j is accepted given that positions 1..j-1 were.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field, replace

import numpy
from scipy.optimize import nnls

# Priors, worth a few steps each: a drafter starts out assumed useful, so it gets measured.
# Greedy and sampled rows are tracked apart: the recursive rejection over a tree's siblings
# accepts more often than one chain's token under sampling, while under greedy decoding a
# tree's siblings rarely hold the argmax (bench/README.md, "Tree vs chain"), so under greedy
# the tree starts out no better than the chain and pays only once measured to.
_PRIOR_ACCEPTANCE = {"draft_model": 0.7, "tree": 0.7, "ngram": 0.5}
_PRIOR_SAMPLED_ACCEPTANCE = {"draft_model": 0.6, "tree": 0.7, "ngram": 0.4}
_PRIOR_WEIGHT = 4.0
# Exponential forgetting of acceptance counts, so the policy follows drift (new prompts, models).
_DECAY = 0.995


class ForwardCostModel:
    """Seconds of one forward as a function of batch rows and new tokens per row.

    Least squares over the median of each (rows, tokens) shape among the last `window`
    observations, of
        seconds = a + b * rows + c * rows * tokens
    (fixed overhead, per-row overhead such as cache gathers and sampling, per-token compute).
    A term is fitted once what it depends on has varied (one row count: no `b`; one token count:
    no `c`). Until then the model is optimistic: a wider forward than those seen costs what they
    did, a narrower one proportionally less, so the policy tries other widths and measures them.
    (Extrapolating the mean cost per token instead made a 5-token verify look 5x a 1-token step:
    a policy that had only seen decode steps never drafted, so never learned otherwise.)
    """

    def __init__(self, window: int = 256) -> None:
        self._observations: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._coefficients: tuple[float, float, float] | None = None
        # median seconds per (rows, tokens) shape in the window, as of the last fit; a shape not
        # in it refits at once (a new term, or a new point of the fit), otherwise every 16
        # observations
        self._measured: dict[tuple[int, int], float] = {}
        self._dirty = 0

    def reset(self) -> None:
        """Forget every observation: the forwards changed (a compiled one replaced the eager one)."""
        self._observations.clear()
        self._coefficients = None
        self._measured = {}
        self._dirty = 0

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        if rows <= 0 or tokens <= 0 or seconds <= 0:
            return
        self._observations.append((rows, tokens, seconds))
        self._dirty += 1
        if self._dirty >= 16 or (rows, tokens) not in self._measured:
            self._fit()

    def _fit(self) -> None:
        self._dirty = 0
        measured: dict[tuple[int, int], list[float]] = {}
        for rows, tokens, seconds in self._observations:
            measured.setdefault((rows, tokens), []).append(seconds)
        self._measured = {shape: statistics.median(values) for shape, values in measured.items()}
        rows_seen = {rows for rows, _, _ in self._observations}
        tokens_seen = {tokens for _, tokens, _ in self._observations}
        # a term is fitted only once what it depends on has varied: with one row count the `1`
        # and `rows` columns are the same, and splitting the overhead between them would
        # extrapolate nonsense to other batch sizes (8-row steps predicting 1 ms for one row)
        columns = [lambda rows, tokens: 1.0]
        if len(rows_seen) >= 2:
            columns.append(lambda rows, tokens: float(rows))
        if len(tokens_seen) >= 2:
            columns.append(lambda rows, tokens: float(rows * tokens))
        if len(columns) == 1:
            self._coefficients = None
            return
        # one point per shape, its median: a one-off outlier (a cold cache, a forward that also
        # measured the machine's kernels, a neighbour's burst) moves nothing unless it is all
        # that was seen of its shape, where least squares over raw observations let one 300 ms
        # draft forward make every draft look expensive (the policy then never drafted)
        shapes = sorted(self._measured)
        # [shapes, columns]
        features = numpy.array([[column(rows, tokens) for column in columns] for rows, tokens in shapes],
                               dtype=numpy.float64)
        # [shapes]
        seconds = [self._measured[shape] for shape in shapes]
        # non-negative least squares: clamping an unconstrained fit's negative overhead to zero
        # left the per-row term fitted with it (draft forwards of 5 and 8 rows, one a cold 22 ms
        # outlier, gave 105 ms per row: a lone row's draft looked 40x what it costs, so a policy
        # at one row never drafted, never measured a draft again and stayed there)
        solution, _ = nnls(features, numpy.array(seconds))
        fitted = iter(solution.tolist())
        a = next(fitted)
        b = next(fitted) if len(rows_seen) >= 2 else 0.0
        c = next(fitted) if len(tokens_seen) >= 2 else 0.0
        self._coefficients = (a, b, c)
        if a + b + c <= 0:  # a degenerate fit: keep the optimistic fallback
            self._coefficients = None

    @property
    def observations(self) -> int:
        return len(self._observations)

    def estimate(self, rows: int, tokens: int) -> float:
        if rows <= 0 or tokens <= 0:
            return 0.0
        if self._coefficients is not None:
            a, b, c = self._coefficients
            # a forward costs no more than one measured with at least as many rows and tokens
            # (the fit extrapolates; the measurement bounds it)
            bound = min((seconds for (seen_rows, seen_tokens), seconds in self._measured.items()
                         if seen_rows >= rows and seen_tokens >= tokens), default=float("inf"))
            return min(a + b * rows + c * rows * tokens, bound)
        if not self._observations:
            return 1e-3
        # optimistic both ways: a wider forward than those seen costs the same, a narrower one
        # proportionally less (so an untried draft or verify width looks worth trying)
        seen_rows, seen_tokens, _ = self._observations[-1]
        mean = sum(s for _, _, s in self._observations) / len(self._observations)
        return mean * min(1.0, rows * tokens / (seen_rows * seen_tokens))


@dataclass
class AcceptanceTracker:
    """Conditional acceptance per draft position, with exponential forgetting."""

    prior: float
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, depth: int, accepted: int) -> None:
        """One step drafted `depth` positions and the target accepted the first `accepted`."""
        if depth <= 0:
            return
        missing = depth - len(self.reached)
        if missing > 0:
            self.reached.extend([0.0] * missing)
            self.accepted.extend([0.0] * missing)
        for position in range(len(self.reached)):
            self.reached[position] *= _DECAY
            self.accepted[position] *= _DECAY
        # position j (0-based) was reached when 0..j-1 were accepted
        for position in range(min(accepted + 1, depth)):
            self.reached[position] += 1.0
            if position < accepted:
                self.accepted[position] += 1.0

    def rate(self, position: int) -> float:
        """P(position accepted | earlier positions accepted), 0-based, shrunk to the prior."""
        reached = self.reached[position] if position < len(self.reached) else 0.0
        accepted = self.accepted[position] if position < len(self.accepted) else 0.0
        prior = self.rate(position - 1) if position > 0 and reached < 1.0 else self.prior
        return (accepted + prior * _PRIOR_WEIGHT) / (reached + _PRIOR_WEIGHT)

    def expected_tokens(self, depth: int) -> float:
        """Tokens one step yields with `depth` drafted positions (the target's own token included)."""
        expected, survive = 1.0, 1.0
        for position in range(depth):
            survive *= self.rate(position)
            expected += survive
        return expected


@dataclass(frozen=True)
class RowOutlook:
    """What the policy needs to know of one decoding row this step."""

    drafter: str
    # the deepest draft the row may take this step (tokens and context left), 0 when none
    max_depth: int
    # a sampled row (its acceptance is tracked apart from greedy rows')
    sampled: bool = False


@dataclass(frozen=True)
class PolicyDecision:
    depth: int
    expected_tokens: float
    estimated_seconds: float
    # drafted although depth 0 looked best: the periodic re-measure of `explore_after`
    explored: bool = False


class SpeculationPolicy:
    """Chooses the draft depth of each batch step; `enabled=False` always drafts `max_depth`.

    With `confidence_scheduling` (the default) the engine asks `decide` nothing: rows draft as
    deep as worth drafting and a scheduler cuts each row's draft to its own verification length
    (batch/scheduling.py); this class then supplies the cost models, the acceptance trackers
    and the exploration counter (`explore_now`, `record_verified`).

    explore_after: after this many depth-0 decisions in a row where a row could have drafted,
    the next one drafts the best positive depth instead (None: never), so the draft's cost and
    acceptance are measured again; each exploration that does not turn the policy round doubles
    the wait, up to `EXPLORE_MAX` (a misjudged cost is corrected within a few steps, a batch
    where drafting truly loses pays about one step in 64). A shape measured once under a
    neighbour's burst is otherwise never measured again: in a real worker, a fresh engine's
    policy still sat at 0 for 17 of 21 steps with a profiled table. Depths only choose how much
    is verified, never what is accepted, so exploring costs some time and nothing of the output.
    """

    EXPLORE_MAX = 64

    def __init__(self, max_depth: int = 8, enabled: bool = True, explore_after: int | None = 4,
                 confidence_scheduling: bool = True) -> None:
        self.max_depth = max_depth
        self.enabled = enabled
        self.explore_after = explore_after
        # per-row verification lengths from survival estimates (batch/scheduling.py) instead of
        # one depth per step from `decide`; only while `enabled`
        self.confidence_scheduling = confidence_scheduling
        self._undrafted = 0  # depth-0 decisions in a row since the last draft
        self._explore_wait = explore_after  # depth-0 decisions before the next exploration
        self.target_costs = ForwardCostModel()
        self.draft_costs = ForwardCostModel()
        # a step's seconds beyond its forwards (drafting, verifying and bookkeeping in Python), by
        # rows x (depth + 1): left out, it made drafting look cheaper than it was in large batches
        self.step_overheads = ForwardCostModel()
        # seconds per drafted position of a drafter that runs per row (tree, ngram)
        self.row_draft_seconds: dict[str, float] = {"ngram": 2e-5}
        self.acceptance: dict[str, AcceptanceTracker] = {}

    def tracker(self, drafter: str, sampled: bool = False) -> AcceptanceTracker:
        """Acceptance of `drafter` under greedy decoding, or under sampling when `sampled`."""
        key = f"{drafter}@sampled" if sampled else drafter
        tracker = self.acceptance.get(key)
        if tracker is None:
            priors = _PRIOR_SAMPLED_ACCEPTANCE if sampled else _PRIOR_ACCEPTANCE
            tracker = self.acceptance[key] = AcceptanceTracker(priors.get(drafter, 0.5))
        return tracker

    def observe_acceptance(self, drafter: str, depth: int, accepted: int,
                           sampled: bool = False) -> None:
        self.tracker(drafter, sampled).observe(depth, accepted)

    def observe_row_draft(self, drafter: str, depth: int, seconds: float) -> None:
        if depth > 0:
            previous = self.row_draft_seconds.get(drafter, seconds / depth)
            self.row_draft_seconds[drafter] = 0.9 * previous + 0.1 * seconds / depth

    def _seconds(self, rows: int, batched_draft_rows: int, per_row: list[str], depth: int,
                 width: int) -> float:
        """Estimated seconds of a step drafting `depth` positions (`width` = forward's min tokens)."""
        seconds = self.target_costs.estimate(rows, max(depth + 1, width))
        if self.step_overheads.observations:
            seconds += self.step_overheads.estimate(rows, depth + 1)
        if depth > 0 and batched_draft_rows:
            # the first draft forward reads one or two context tokens, then one per position
            seconds += self.draft_costs.estimate(batched_draft_rows, 2)
            seconds += (depth - 1) * self.draft_costs.estimate(batched_draft_rows, 1)
        for drafter in per_row:
            seconds += depth * self.row_draft_seconds.get(drafter, 0.0)
        return seconds

    def decide(self, outlooks: list[RowOutlook], other_rows: int = 0, width: int = 1) -> PolicyDecision:
        """The depth to draft for the decoding rows in `outlooks`.

        other_rows: rows in the same forward that do not draft (prefilling, seeded rows on their
        own schedule); they add to the forward's cost and yield their own tokens either way.
        width: the fewest tokens per row the forward will have anyway (a prefill chunk).
        """
        rows = len(outlooks) + other_rows
        deepest = min(self.max_depth, max((o.max_depth for o in outlooks), default=0))
        if not self.enabled or deepest == 0:
            return PolicyDecision(deepest, 0.0, 0.0)
        batched = sum(1 for o in outlooks if o.drafter == "draft_model")
        per_row = [o.drafter for o in outlooks if o.drafter not in ("draft_model", "none")]
        best = best_drafting = None
        for depth in range(deepest + 1):
            tokens = float(other_rows)
            for outlook in outlooks:
                reach = min(depth, outlook.max_depth) if outlook.drafter != "none" else 0
                tokens += self.tracker(outlook.drafter, outlook.sampled).expected_tokens(reach)
            seconds = self._seconds(rows, batched, per_row, depth, width)
            decision = PolicyDecision(depth, tokens, seconds)
            if best is None or tokens / seconds > best.expected_tokens / best.estimated_seconds:
                best = decision
            if depth and (best_drafting is None or tokens / seconds
                          > best_drafting.expected_tokens / best_drafting.estimated_seconds):
                best_drafting = decision
        if best.depth or best_drafting is None:
            self._undrafted, self._explore_wait = 0, self.explore_after
            return best
        self._undrafted += 1
        if self._explore_wait is None or self._undrafted < self._explore_wait:
            return best
        self._undrafted, self._explore_wait = 0, min(2 * self._explore_wait, self.EXPLORE_MAX)
        return replace(best_drafting, explored=True)

    def forward_seconds(self, rows: int, tokens: float) -> float:
        """Estimated seconds of a verify forward of `rows` x `tokens` with the step's overhead
        beyond its forwards (what a step of that width costs but its drafting)."""
        seconds = self.target_costs.estimate(rows, tokens)
        if self.step_overheads.observations:
            seconds += self.step_overheads.estimate(rows, tokens)
        return seconds

    def explore_now(self) -> bool:
        """Under confidence scheduling: whether this step drafts and verifies regardless of the
        estimates, after `explore_after` (doubling up to EXPLORE_MAX) steps in a row that could
        have verified a draft and verified none (the same re-measure as `decide`'s)."""
        if self._explore_wait is None or self._undrafted < self._explore_wait:
            return False
        self._undrafted, self._explore_wait = 0, min(2 * self._explore_wait, self.EXPLORE_MAX)
        return True

    def record_verified(self, verified: bool, could: bool) -> None:
        """A scheduled step verified a draft (resets the exploration wait), or could have and did not."""
        if verified:
            self._undrafted, self._explore_wait = 0, self.explore_after
        elif could:
            self._undrafted += 1

    def choose_drafter(self, available: list[str], rows: int, depth: int = 4,
                       sampled: bool = False, node_budget: int = 8) -> str:
        """For `drafter: "auto"`: the available drafter with the best expected tokens per second.

        A tree of `node_budget` nodes is verified in a forward that wide, not `depth + 1`: on a
        CPU, where extra tokens cost real compute, that is what keeps it from being chosen
        where its extra acceptance does not pay for its extra nodes.
        """
        best, best_rate = available[0], -1.0
        for drafter in available:
            reach = 0 if drafter == "none" else depth
            per_row = [] if drafter in ("draft_model", "none") else [drafter]
            width = node_budget + 1 if drafter == "tree" else 1
            seconds = self._seconds(rows, rows if drafter == "draft_model" else 0, per_row, reach,
                                    width)
            rate = self.tracker(drafter, sampled).expected_tokens(reach) / max(seconds, 1e-9)
            if rate > best_rate:
                best, best_rate = drafter, rate
        return best
