"""The tokenizer of the version a request is about to use, or a 503 naming the model.

Apart from ``tokenizer_for`` (the cache by directory, which routing uses too) because it needs
``inference.generations``: the refusal is a ``ModelUnavailable`` that both APIs map to a 503.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from inference.api.tokenizers import tokenizer_for
from inference.generations import ModelUnavailable, require_files
from metadata.models import ModelVersion


def tokenizer_of(version: ModelVersion) -> PreTrainedTokenizerBase:
    """``version``'s tokenizer; ``ModelUnavailable`` when its files are missing
    (``inference.version_files``), or when they are there but transformers cannot read them."""
    require_files(version)
    try:
        return tokenizer_for(str(version.directory))
    except Exception as error:  # transformers raises OSError, ValueError or a JSON error by the file at fault
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ModelUnavailable(version, f"its tokenizer in {version.directory} cannot be loaded ({reason})") from error
