"""Adaptive draft length: longer after a fully accepted draft, shorter after a rejection."""

from __future__ import annotations

from inference.engine.config import DraftConfig


class DraftLengthSchedule:
    """The draft depth to ask for at the next step.

    With `adaptive` off the depth stays at the drafter's nominal depth. With it on, a step
    whose whole draft was accepted adds one (up to max_length) and a step with a rejection
    removes one (down to min_length), the rule HF's assisted generation also uses, but by one
    in both directions because on a CPU every extra drafted token costs target compute.
    """

    def __init__(self, config: DraftConfig, nominal_depth: int) -> None:
        self.adaptive = config.adaptive
        self.min_length = config.min_length
        self.max_length = config.max_length
        self.length = (min(max(nominal_depth, config.min_length), config.max_length)
                       if config.adaptive else nominal_depth)

    def update(self, drafted_depth: int, accepted: int) -> None:
        if not self.adaptive or drafted_depth == 0:
            return
        if accepted >= drafted_depth:
            self.length = min(self.length + 1, self.max_length)
        else:
            self.length = max(self.length - 1, self.min_length)
