"""Errors the engine raises, so callers can tell bad input from a broken model pair."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the speculative decoding engine raises on purpose."""


class ConfigError(EngineError, ValueError):
    """A generation or draft setting breaks a rule; the message names the field and the rule."""


class PromptTooLongError(EngineError, ValueError):
    """The prompt leaves no room in the target's context for even one new token."""

    def __init__(self, prompt_tokens: int, context_length: int) -> None:
        super().__init__(
            f"prompt has {prompt_tokens} tokens but the model's context holds {context_length}: "
            f"the prompt must be at most {context_length - 1} tokens to generate anything"
        )
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


class UnsupportedModelError(EngineError):
    """The model pair cannot be run by the engine (no context length, a cache that cannot roll back, ...)."""
