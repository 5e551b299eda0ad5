"""Held-out prompts for the demo pair: openings of functions in files never trained on.

The benchmark and the build's own acceptance estimate read the same `heldout_prompts.json`, so
the figures they report are measured on the same text. The file's format (reading, writing) is
`inference.heldout_prompts`; `load_heldout_prompts` is re-exported here for the benchmarks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from inference.demo.corpus import SourceFile
from inference.heldout_prompts import load_heldout_prompts

__all__ = ["heldout_prompts", "load_heldout_prompts"]

_FUNCTION_START = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]", re.MULTILINE)
# Characters per token are about 3-4 for code; 8 leaves room for whitespace-heavy files.
_CHARS_PER_TOKEN_BOUND = 8


def heldout_prompts(
    files: Sequence[SourceFile],
    tokenizer: PreTrainedTokenizerBase,
    count: int,
    prompt_tokens: int,
    min_following_tokens: int = 0,
) -> list[dict[str, object]]:
    """Pick `count` function openings, evenly spread over the held-out files, `prompt_tokens` long.

    Only functions followed by at least `min_following_tokens` more tokens qualify, so a
    continuation of that length is still code, not the end of a file.
    """
    needed = prompt_tokens + min_following_tokens
    candidates: list[tuple[str, int, list[int]]] = []
    for source in files:
        text = source.read()
        for match in _FUNCTION_START.finditer(text):
            window = text[match.start() : match.start() + needed * _CHARS_PER_TOKEN_BOUND]
            ids = tokenizer(window, add_special_tokens=False)["input_ids"]
            if len(ids) >= needed:
                line = text.count("\n", 0, match.start()) + 1
                candidates.append((source.relative, line, ids[:prompt_tokens]))
    if len(candidates) < count:
        raise ValueError(
            f"held-out files hold {len(candidates)} functions long enough for prompts of "
            f"{prompt_tokens}+{min_following_tokens} tokens; {count} are needed"
        )
    stride = len(candidates) / count
    chosen = [candidates[int(index * stride)] for index in range(count)]
    return [
        {"id": index, "source": relative, "line": line, "text": tokenizer.decode(ids)}
        for index, (relative, line, ids) in enumerate(chosen)
    ]
