"""The one interface every drafter implements: propose a draft tree for the current context."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from inference.engine.config import DraftConfig
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.sampling import SamplingParams


@dataclass(frozen=True)
class DraftRequest:
    """What the decoder asks for at one step.

    max_depth: the deepest node the step may use (the adaptive length, capped by the tokens and
    context left). sampling: None for greedy; otherwise the same warping the target uses, so a
    drafter that samples draws from exactly the q the verifier divides by.
    """

    max_depth: int
    sampling: SamplingParams | None = None
    generator: torch.Generator | None = None


class Drafter(ABC):
    """Proposes tokens; never sees the target's output or the verification rule.

    A drafter is a function of the context it is given: when the context rolls back or
    diverges from what it drafted, it resynchronises its own state (e.g. a draft KV cache).
    """

    #: the kind's name in the list of drafter kinds (drafters/kinds.py sets it; no second list)
    name: str = ""

    def __init__(self, config: DraftConfig) -> None:
        self.config = config

    @property
    @abstractmethod
    def nominal_depth(self) -> int:
        """The draft depth to start with (the adaptive schedule moves from here)."""

    @property
    def draft_model(self) -> PreTrainedModel | None:
        """The model this drafter feeds, if any: prompt ids must fit its embedding too."""
        return None

    def begin(self, prompt_ids: list[int]) -> None:
        """Reset per-generation state before a new prompt."""

    @abstractmethod
    def propose(self, context: list[int], request: DraftRequest) -> DraftTree:
        """Return a draft tree that continues `context`, no deeper than request.max_depth."""


class NoDrafter(Drafter):
    """Target only: the same loop with empty drafts, one token per step."""

    @property
    def nominal_depth(self) -> int:
        return 0

    def propose(self, context: list[int], request: DraftRequest) -> DraftTree:
        return DraftTree.empty()
