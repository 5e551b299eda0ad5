"""Which nodes a dynamic draft tree draws next: best-first over known and expected values.

The tree grows in rounds, one draft forward each. At the start of a round every node drawn so
far that may still have children has been fed to the draft, so its candidate children are
known with calibrated values (the estimated probability that the target accepts the whole
path down to them). Nodes drawn now can have children only in later rounds, and their values
are not known yet: they are estimated from the mean value of each sibling rank.

`plan_round` takes the `room` best nodes of the tree made of the known candidates and the
expected descendants of every node taken (EAGLE-2's global top-k over path values, looking
ahead), and returns how many children of each known node to draw in this round. A node taken
for the future keeps room for it, so one round never spends the budget that deeper, more
valuable nodes need. Values along a path never increase (each factor is a probability), so
the nodes taken are closed under ancestors.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownSlots:
    """The next candidate children of one drawn node (or of the context's last token, -1)."""

    # log value of the path down to the node (0.0 for the context's last token)
    log_value: float
    # depth of the node (0 for the context's last token)
    depth: int
    # log value of each further child, best first, relative to the node (non-increasing)
    child_log_values: Sequence[float]


def plan_round(
    known: Mapping[int, KnownSlots],
    # log value of the r-th child of a node whose candidates are not known yet, best first
    expected_child_log_values: Sequence[float],
    room: int,
    max_depth: int,
) -> dict[int, int]:
    """{node: how many more children to draw for it now}; at most `room` in all nodes."""
    # entries: (-log value, depth, order, kind, payload); known before expected at equal value
    heap: list[tuple[float, int, int, int, tuple]] = []
    order = 0

    def push(log_value: float, depth: int, kind: int, payload: tuple) -> None:
        nonlocal order
        heapq.heappush(heap, (-log_value, depth, kind, order, payload))
        order += 1

    def push_expected_child(parent_log_value: float, depth: int, rank: int) -> None:
        if depth < max_depth and rank < len(expected_child_log_values):
            push(parent_log_value + expected_child_log_values[rank], depth + 1, 1,
                 (parent_log_value, rank))

    for node, slots in known.items():
        if slots.depth < max_depth and slots.child_log_values:
            push(slots.log_value + slots.child_log_values[0], slots.depth + 1, 0, (node, 0))
    draws: dict[int, int] = {}
    taken = 0
    while heap and taken < room:
        negative, depth, kind, _, payload = heapq.heappop(heap)
        taken += 1
        if kind == 0:
            node, rank = payload
            draws[node] = draws.get(node, 0) + 1
            slots = known[node]
            if rank + 1 < len(slots.child_log_values):
                push(slots.log_value + slots.child_log_values[rank + 1], depth, 0, (node, rank + 1))
        else:
            parent_log_value, rank = payload
            push_expected_child(parent_log_value, depth - 1, rank + 1)
        push_expected_child(-negative, depth, 0)
    return draws
