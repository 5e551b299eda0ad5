"""One generation's grammar state: which tokens may come next, along the committed output.

The state advances only on committed tokens. Verification asks for the allowed tokens at
every node of a draft tree (`masks_along`): the matcher walks each path, reads the mask,
and rolls back, so it leaves as it came. A draft token the grammar forbids is marked invalid;
its descendants are never reachable, and their rows reuse their parent's mask so every row
keeps at least one allowed token (a row of -inf everywhere would be NaN after softmax).
"""

from __future__ import annotations

import numpy as np
import llguidance
import torch

from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.stopping import FINISH_STOP, StopCondition
from inference.engine.errors import EngineError


class GrammarStateError(EngineError):
    """A token the mask allowed was refused by the grammar: a bug, never bad input."""


class GrammarMatcher:
    """Wraps an llguidance matcher for one generation (see grammar.new_matcher)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens the grammar allows next."""
        if self._matcher.is_error():  # e.g. a parser limit reached: no mask to trust
            raise GrammarStateError(f"grammar failed: {self._matcher.get_error()}")
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: self.vocab_size]
        if bits.shape[0] < self.vocab_size:
            bits = np.pad(bits, (0, self.vocab_size - bits.shape[0]))
        return torch.from_numpy(bits.astype(bool))

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and admits nothing more."""
        return self._matcher.is_stopped()

    def advance(self, tokens: list[int]) -> None:
        """Commit `tokens` (each one the mask allowed)."""
        for token in tokens:
            if not self._matcher.consume_token(token):
                raise GrammarStateError(f"grammar refused token {token}: {self._matcher.get_error()}")

    def rollback(self, count: int) -> None:
        if count > 0 and not self._matcher.rollback(count):
            raise GrammarStateError(f"grammar could not roll back {count} tokens: {self._matcher.get_error()}")

    def commit(self, tokens: list[int]) -> tuple[list[int], bool]:
        """Advance over `tokens` up to the one that completes the grammar; return (kept, completed).

        Tokens after the grammar's end are cut: the output ends where the grammar does.
        """
        for index, token in enumerate(tokens):
            self.advance([token])
            if self._matcher.is_stopped():
                return tokens[: index + 1], True
        return tokens, False

    def forced_tokens(self, limit: int) -> list[int]:
        """The tokens the grammar admits as the only continuation (at most `limit`)."""
        if limit <= 0 or self._matcher.is_stopped():
            return []
        return list(self._matcher.compute_ff_tokens()[:limit])

    def masks_along(self, tree: DraftTree) -> tuple[torch.Tensor, list[bool]]:
        """The allowed tokens at the last context token and after every node, and each node's validity.

        Returns ([1 + nodes, vocab_size] bool, [nodes] bool): row 0 is the mask now, row 1 + i
        the mask after node i's path; a node is valid when its whole path is allowed.
        """
        masks = [self.allowed()]
        masks.extend([masks[0]] * len(tree))
        valid = [False] * len(tree)
        self._walk(tree, 0, masks, valid)
        return torch.stack(masks), valid

    def _walk(self, tree: DraftTree, row: int, masks: list[torch.Tensor], valid: list[bool]) -> None:
        for child in tree.children[row]:
            token = tree.token_ids[child]
            masks[child + 1] = masks[row]
            if not (token < self.vocab_size and bool(masks[row][token])):
                continue
            self.advance([token])
            valid[child] = True
            after = self.allowed()
            if bool(after.any()):  # a complete grammar with no EOS id allows nothing
                masks[child + 1] = after
            self._walk(tree, child + 1, masks, valid)
            self.rollback(1)


def commit_step(
    matcher: GrammarMatcher | None,
    stop: StopCondition,
    generated: list[int],
    new_tokens: list[int],
) -> tuple[list[int], str | None]:
    """A step's tokens to emit and its finish reason, with the grammar advanced over exactly them.

    The grammar cuts first (the output ends where it completes: finish reason "stop"), then the
    stop condition (length, EOS, stop strings); what it cuts is rolled back out of the grammar.
    Without a matcher this is `stop.clip`.
    """
    if matcher is None:
        return stop.clip(generated, new_tokens)
    kept, completed = matcher.commit(new_tokens)
    emitted, finish_reason = stop.clip(generated, kept)
    matcher.rollback(len(kept) - len(emitted))
    return emitted, finish_reason or (FINISH_STOP if completed else None)
