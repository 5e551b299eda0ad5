"""The engine's scheduler of rows: fair admission across groups of requests, and preemption.

`RowScheduler` is a component the batching engine (engine.py, `BatchedSpeculativeEngine`)
holds as `scheduler`: it owns the waiting rows, the groups' weights and clocks (`FairAdmission`),
the preemption switch and the admission and preemption counts, and decides which waiting row
gets a place and which running row gives its place up for whom. It holds no engine: at each
step boundary the engine hands `plan` the rows holding a place and the number of places, and
carries out the `Admission`s it returns in order (takes a preempted row out, `_preempt`, and
places a row, `_place`); the caches, the prefill lane and the rows' state stay the engine's.
Its interface: `submit`, `withdraw`, `plan`, `charge`, `forget_idle`, and `waiting`/`preemptions`
to read.

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
rows back and forth (with equal weights: a difference of two rows or more). The giver's
youngest `preemptible` row goes back to the head of its group's queue, and the engine takes it
out of the batch with its tokens (recompute preemption, `BatchedSpeculativeEngine._preempt`).
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
        # ordered (queue order, then the batch's), never a set: ties go the same way in every
        # process, whatever the hash seed of the groups' names
        first_waiting: dict[Hashable, int] = {}
        for position, row in enumerate(waiting):
            first_waiting.setdefault(group_of(row), position)
        active = list(dict.fromkeys([*first_waiting, *(group for group, count in held.items() if count)]))
        if len(active) < 2:
            return None
        takers = sorted((g for g in first_waiting if held[g] < self.share(g, active, max_rows)),
                        key=lambda g: (self._load(g, held), self._clock(g), first_waiting[g]))
        for taker in takers:
            after_taker = (held[taker] + 1) / self.weights.get(taker, 1.0)
            givers = [g for g in active
                      if g != taker and preemptible[g] and held[g] > self.share(g, active, max_rows)
                      and (held[g] - 1) / self.weights.get(g, 1.0) >= after_taker]
            if givers:
                giver = max(givers, key=lambda g: (self._load(g, held), self._clock(g)))
                return taker, giver
        return None


@dataclass(frozen=True)
class Admission:
    """A waiting row to place, after taking `preempts` (a running row) out when it is set."""

    row: BatchRow
    preempts: BatchRow | None = None


def preemptible(row: BatchRow) -> bool:
    """Whether the row may give up its place: its request allows it, it has not ended, and its
    drafter holds nothing a second prefill would feed it again (a feature-reading, DSpark, row's
    drafter holds the target's features of its positions)."""
    return (row.request.preemptible and row.finish_reason is None and not reads_features(row)
            and not row.keeps_last_prompt_token)


class RowScheduler:
    """The engine's scheduler of rows: who waits, who gets a row, who gives one up (module docstring).

    It holds the waiting rows (`waiting`, in arrival order; a preempted row goes back first), the
    groups' `FairAdmission`, the preemption switch and the counts, and sees the engine's rows
    only as `plan` is handed them: the engine places and takes out rows itself.
    """

    def __init__(self, preemption: bool = True) -> None:
        self.waiting: deque[BatchRow] = deque()
        self.fairness = FairAdmission()
        self.preemption = preemption
        self.preemptions = 0  # rows preempted since the scheduler was built
        self._admissions = 0  # rows admitted so far: a row's `admitted` is the count when it got its place

    def submit(self, row: BatchRow) -> None:
        """Queue a new row (its group's weight is its request's from now on)."""
        self.fairness.note_request(row)
        self.waiting.append(row)

    def withdraw(self, row: BatchRow) -> None:
        """Take a waiting row out of the queue (it ended there: cancelled, past its deadline)."""
        self.waiting.remove(row)

    def charge(self, row: BatchRow, tokens: int) -> None:
        """Count `tokens` (prompt tokens fed and tokens generated) served to the row's group."""
        self.fairness.charge(group_of(row), tokens)

    def forget_idle(self, running: Iterable[BatchRow]) -> None:
        """At the end of a step: forget the groups with no row `running` or waiting."""
        self.fairness.forget_idle(group_of(row) for row in [*running, *self.waiting])

    def plan(self, running: Iterable[BatchRow], max_rows: int) -> list[Admission]:
        """This step boundary's admissions, for the engine to carry out in order: `running` is
        every row holding a place (the batch's and the prefill lane's), `max_rows` the places.

        Free places go to waiting rows, the fairest first; then, with every place taken and a
        group under its share waiting, each admission takes the place of the youngest preemptible
        row of a group over its share (at most `max_rows` of them: each narrows the gap between
        two groups). The queue, the rows' `admitted` numbers and the counts are updated here, as
        the engine will have done it: a row planned out is back at the head of the queue."""
        running = list(running)
        admissions: list[Admission] = []
        while self.waiting and len(running) < max_rows:
            admissions.append(Admission(self._admit(self.fairness.pick(self.waiting, _held(running)), running)))
        if not self.preemption or not self.waiting:
            return admissions
        for _ in range(max_rows):
            givers = Counter(group_of(row) for row in running if preemptible(row))
            pair = self.fairness.victim_group(self.waiting, _held(running), max_rows, givers)
            if pair is None:
                break
            taker, giver = pair
            victim = max((row for row in running if group_of(row) == giver and preemptible(row)),
                         key=lambda row: row.admitted)
            running.remove(victim)
            self.preemptions += 1
            self.waiting.appendleft(victim)  # ahead of its group's later arrivals
            row = self._admit(next(row for row in self.waiting if group_of(row) == taker), running)
            admissions.append(Admission(row, victim))
        return admissions

    def _admit(self, row: BatchRow, running: list[BatchRow]) -> BatchRow:
        self.waiting.remove(row)
        running.append(row)
        self._admissions += 1
        row.admitted = self._admissions
        self.fairness.note_admitted(row)
        return row


def _held(running: Iterable[BatchRow]) -> Counter:
    """Rows holding a place, by fair group."""
    return Counter(group_of(row) for row in running)
