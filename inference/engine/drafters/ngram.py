"""N-gram drafter (prompt lookup): find the last n tokens earlier in the context, propose what followed.

No model: an index from each n-gram to the position after its most recent earlier occurrence,
updated incrementally as the context grows, so a step costs O(new tokens), not O(context).
Longer matches are tried first (ngram_size down to ngram_min_size). Proposals are deterministic,
so the tree carries no draft distribution and the verifier treats them as point masses.
"""

from __future__ import annotations

from inference.engine.config import DraftConfig
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.drafters.base import Drafter, DraftRequest


class NgramDrafter(Drafter):
    """Prompt-lookup drafting over the prompt and everything generated so far."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__(config)
        self.sizes = range(config.ngram_size, config.ngram_min_size - 1, -1)
        self._context: list[int] = []
        # _follows[n][ngram] = index of the token that followed the ngram's latest occurrence
        self._follows: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}

    @property
    def nominal_depth(self) -> int:
        return self.config.length

    def begin(self, prompt_ids: list[int]) -> None:
        self._context = []
        self._follows = {n: {} for n in self.sizes}

    def _index(self, context: list[int]) -> None:
        """Record every n-gram that now has a following token."""
        known = len(self._context)
        if context[:known] != self._context:
            self.begin(context)
            known = 0
        # an n-gram ending at index end - 1 is followed by context[end]; index ends < len(context)
        for end in range(max(known - 1, 0), len(context) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self._follows[n][tuple(context[end + 1 - n:end + 1])] = end + 1
        self._context = list(context)

    def propose(self, context: list[int], request: DraftRequest) -> DraftTree:
        length = request.max_depth
        if length <= 0 or not context:
            return DraftTree.empty()
        self._index(context)
        for n in self.sizes:
            if len(context) <= n:
                continue
            start = self._follows[n].get(tuple(context[-n:]))
            if start is not None:
                return DraftTree.chain(context[start:start + length])
        return DraftTree.empty()
