"""Tokenizers for request validation in the web process (small; loaded once per path)."""
from __future__ import annotations

from functools import lru_cache

from transformers import AutoTokenizer, PreTrainedTokenizerBase


@lru_cache(maxsize=16)
def tokenizer_for(directory: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)
