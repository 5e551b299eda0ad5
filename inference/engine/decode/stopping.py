"""Where a generation ends: max_new_tokens, EOS, stop strings (on decoded text).

Shared by the speculative loop and the target-only loop so both cut at the same token.
"""

from __future__ import annotations

from collections.abc import Callable

from inference.engine.config import GenerationConfig
from inference.engine.errors import ConfigError

FINISH_LENGTH = "length"
FINISH_EOS = "eos"
FINISH_STOP = "stop"


class StopCondition:
    """Cuts each step's new tokens at the first stop and says why generation finished."""

    def __init__(
        self,
        config: GenerationConfig,
        max_new_tokens: int,
        decode: Callable[[list[int]], str] | None,
    ) -> None:
        if config.stop_strings and decode is None:
            raise ConfigError("stop_strings: need a decode function to match decoded text")
        self.max_new_tokens = max_new_tokens
        self.eos_ids = config.eos_token_ids
        self.stop_strings = config.stop_strings
        self.decode = decode

    def clip(self, generated: list[int], new_tokens: list[int]) -> tuple[list[int], str | None]:
        """Return the part of `new_tokens` to emit after `generated`, and a finish reason or None."""
        reason = None
        room = self.max_new_tokens - len(generated)
        if len(new_tokens) >= room:
            new_tokens, reason = new_tokens[:room], FINISH_LENGTH
        if self.eos_ids:
            for index, token in enumerate(new_tokens):
                if token in self.eos_ids:
                    new_tokens, reason = new_tokens[: index + 1], FINISH_EOS
                    break
        if self.stop_strings:
            cut = self._stop_string_cut(generated, new_tokens)
            if cut is not None:
                new_tokens, reason = new_tokens[:cut], FINISH_STOP
        return new_tokens, reason

    def _stop_string_cut(self, generated: list[int], new_tokens: list[int]) -> int | None:
        """The fewest new tokens whose decoded text completes a stop string, or None."""
        if not new_tokens or not self._has_stop(generated + new_tokens):
            return None
        for count in range(1, len(new_tokens) + 1):
            if self._has_stop(generated + new_tokens[:count]):
                return count
        return len(new_tokens)

    def _has_stop(self, tokens: list[int]) -> bool:
        text = self.decode(tokens)
        return any(stop in text for stop in self.stop_strings)
