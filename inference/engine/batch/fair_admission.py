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
its group's queue (recompute preemption, engine.py `_preempt`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
