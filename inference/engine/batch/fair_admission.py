"""Fair admission across groups of requests, and which row to preempt for a starved group.

The batching engine (engine.py) knows no tenants: each `BatchRequest` carries an opaque
`fair_group` (the worker passes the tenant; None for every request is one group, first in first
out) and a `fair_weight`. A group's **share** of the batch is `max_rows * weight / total weight`
of the groups with rows held or waiting; a row is **held** while it has a row of the batch's
caches or of the prefill lane.

Admission (`pick`): while rows are free, the next waiting row is the head of the group that holds
the fewest rows per weight, ties going to the group that has been served the fewest tokens per
weight (a virtual clock, as in weighted fair queueing or Linux's CFS: a group that comes back
after being idle starts at the smallest clock of the active groups, so idleness banks no
credit), then to the group admitted least recently (round-robin), then to the earliest
arrival. Within a group rows stay first in, first out.

Preemption (`victim_group`): when the batch is full and a waiting group holds less than its
share while another holds more, the over-share group gives up a row. Only when the move leaves
the giver holding at least as many rows per weight as the taker, so two groups can never take
rows back and forth (with equal weights: a difference of two rows or more). The engine then
takes the giver's youngest row out of the batch with its tokens and puts it back at the head of
its group's queue (recompute preemption, `FairRows._preempt`).

`FairRows` is the engine's side (a mixin of `BatchedSpeculativeEngine`, engine.py, which owns
the rows, the lane, the caches and `_place`/`_release`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from inference.engine.batch.feature_rows import reads_features
from inference.engine.batch.rows import BatchRow


def group_of(row: BatchRow) -> Hashable:
    return row.request.fair_group


@dataclass
class FairAdmission:
    """The groups' weights and virtual clocks (tokens served per weight); see the module docstring."""

    weights: dict[Hashable, float] = field(default_factory=dict)
    clocks: dict[Hashable, float] = field(default_factory=dict)
    # each group's latest admission (a running count), for the round-robin tie-break
    turns: dict[Hashable, int] = field(default_factory=dict)
    _admissions: int = 0

    def note_request(self, row: BatchRow) -> None:
        """A group's weight is its latest request's."""
        self.weights[group_of(row)] = max(float(row.request.fair_weight), 1e-6)

    def note_admitted(self, row: BatchRow) -> None:
        self._admissions += 1
        self.turns[group_of(row)] = self._admissions

    def charge(self, group: Hashable, tokens: int) -> None:
        """Count `tokens` (prompt tokens fed and tokens generated) served to `group`."""
        if tokens:
            self.clocks[group] = self._clock(group) + tokens / self.weights.get(group, 1.0)

    def forget_idle(self, active: Iterable[Hashable]) -> None:
        """Drop the clocks and weights of groups with nothing held or waiting."""
        keep = set(active)
        for table in (self.clocks, self.weights, self.turns):
            for group in [group for group in table if group not in keep]:
                del table[group]

    def _clock(self, group: Hashable) -> float:
        if group in self.clocks:
            return self.clocks[group]
        # a group (re)joining starts at the least-served active group's clock: no banked credit
        clock = min(self.clocks.values(), default=0.0)
        self.clocks[group] = clock
        return clock

    def _load(self, group: Hashable, held: Counter) -> float:
        return held[group] / self.weights.get(group, 1.0)

    def pick(self, waiting: Iterable[BatchRow], held: Counter) -> BatchRow | None:
        """The waiting row to admit next (None when nothing waits)."""
        heads: dict[Hashable, tuple[int, BatchRow]] = {}
        for position, row in enumerate(waiting):
            heads.setdefault(group_of(row), (position, row))
        if not heads:
            return None
        if len(heads) == 1:
            return next(iter(heads.values()))[1]
        group = min(heads, key=lambda g: (self._load(g, held), self._clock(g), self.turns.get(g, 0), heads[g][0]))
        return heads[group][1]

    def share(self, group: Hashable, active: Iterable[Hashable], max_rows: int) -> float:
        """Rows the group is entitled to among the `active` groups."""
        total = sum(self.weights.get(g, 1.0) for g in set(active))
        return max_rows * self.weights.get(group, 1.0) / total if total else float(max_rows)

    def victim_group(self, waiting: Iterable[BatchRow], held: Counter, max_rows: int,
                     preemptible: Counter) -> tuple[Hashable, Hashable] | None:
        """(taker, giver): a waiting group under its share and a group over its share that should
        give it a row, or None. `preemptible`: each group's rows that may be preempted."""
        waiting_groups = {group_of(row) for row in waiting}
        active = set(waiting_groups) | {group for group, count in held.items() if count}
        if len(active) < 2:
            return None
        takers = sorted((g for g in waiting_groups if held[g] < self.share(g, active, max_rows)),
                        key=lambda g: (self._load(g, held), self._clock(g)))
        for taker in takers:
            after_taker = (held[taker] + 1) / self.weights.get(taker, 1.0)
            givers = [g for g in active
                      if g != taker and preemptible[g] and held[g] > self.share(g, active, max_rows)
                      and (held[g] - 1) / self.weights.get(g, 1.0) >= after_taker]
            if givers:
                giver = max(givers, key=lambda g: (self._load(g, held), self._clock(g)))
                return taker, giver
        return None


class FairRows:
    """Admission and preemption of the engine's waiting rows (see the module docstring)."""

    def _init_fair_rows(self, preemption: bool) -> None:
        self.waiting: deque[BatchRow] = deque()  # in arrival order; a preempted row goes back first
        self.fairness = FairAdmission()
        self.preemption = preemption
        self.preemptions = 0  # rows preempted since the engine was built
        self._admissions = 0

    def _held(self) -> Counter:
        """Rows of the batch and the lane, by fair group."""
        return Counter(group_of(row) for row in self.rows + self.lane_rows)

    def _admit(self) -> None:
        """Give free rows to waiting requests, the fairest first; then, with a full batch and a
        group under its share waiting, preempt rows of groups over theirs."""
        while self.waiting and len(self.rows) + len(self.lane_rows) < self.max_rows:
            self._place(self.fairness.pick(self.waiting, self._held()))
        if not self.preemption or not self.waiting:
            return
        for _ in range(self.max_rows):  # each preemption narrows the gap between two groups
            held = self._held()
            preemptible = Counter(group_of(row) for row in self.rows + self.lane_rows if self._preemptible(row))
            pair = self.fairness.victim_group(self.waiting, held, self.max_rows, preemptible)
            if pair is None:
                return
            taker, giver = pair
            self._preempt(max((row for row in self.rows + self.lane_rows
                               if group_of(row) == giver and self._preemptible(row)),
                              key=lambda row: row.admitted))
            self._place(next(row for row in self.waiting if group_of(row) == taker))

    def _note_admitted(self, row: BatchRow) -> None:
        self._admissions += 1
        row.admitted = self._admissions
        self.fairness.note_admitted(row)

    @staticmethod
    def _preemptible(row: BatchRow) -> bool:
        # a feature-reading (DSpark) row's drafter holds the target's features of its positions,
        # which a second prefill would feed it again
        return (row.request.preemptible and row.finish_reason is None and not reads_features(row)
                and not row.keeps_last_prompt_token)

    def _preempt(self, row: BatchRow) -> None:
        """Take a row out of the batch (or the lane) at this step boundary and put it back at the
        head of its group's queue (recompute preemption, as vLLM's).

        The row keeps its tokens, generator, stop condition, grammar state, drafter and draft
        schedule: only its cache rows go, after offering their keys and values to the prefix
        cache. Its context (prompt and every token generated) becomes the prompt it prefills when
        admitted again (adopting what the prefix cache holds), exactly as a session resumed from
        its committed tokens does; the pending token is the same and a seeded row's draws are
        seeded by position (decoder.reseed_at), so it goes on with the tokens it would have made.
        """
        self._release([row])
        row.prompt_length = len(row.context)
        row.prefilled = 0
        row.draft_synced, row.draft_extra = 0, []
        row.prefix_offered = False
        row.fed_prompt = 0
        row.forced_step = False
        row.stats.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(row)  # ahead of its group's later arrivals
