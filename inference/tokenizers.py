"""Tokenizers in the web process: request validation, conversation routing, the admin's pages.

``tokenizer_for`` loads a model directory's tokenizer once (small; kept per directory);
``tokenizer_of`` is the tokenizer of the version a request is about to use, or a
``ModelUnavailable`` (a 503 naming the model in both APIs) when its files are missing or
transformers cannot read them.

transformers (and torch, which it imports: ~5 s on the 2-core machine) loads with the first
tokenizer, not with this module, so a process that imports it and never tokenizes does not pay for
it. The web process loads it before it serves (``load_transformers``, from ``specops/asgi.py``),
so no request does.
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from inference.served_targets import ModelUnavailable, require_files
from metadata.models import ModelVersion

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_transformers() -> None:
    """Import transformers now (seconds), so that the first tokenizer loaded does not."""
    import transformers  # noqa: F401


@lru_cache(maxsize=16)
def tokenizer_for(directory: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def tokenizer_of(version: ModelVersion) -> PreTrainedTokenizerBase:
    """``version``'s tokenizer; ``ModelUnavailable`` when its files are missing
    (``inference.version_files``), or when they are there but transformers cannot read them."""
    require_files(version)
    try:
        return tokenizer_for(str(version.directory))
    except Exception as error:  # transformers raises OSError, ValueError or a JSON error by the file at fault
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ModelUnavailable(version, f"its tokenizer in {version.directory} cannot be loaded ({reason})") from error
