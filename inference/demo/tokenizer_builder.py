"""Train byte-level BPE tokenizers locally, for models built without a network.

A byte-level BPE (GPT-2's scheme) encodes any string losslessly, so a tokenizer trained on a
small sample of the standard library still round-trips every prompt. The result is a
`PreTrainedTokenizerFast` that `save_pretrained` writes next to a model and `AutoTokenizer`
loads back like any Hugging Face tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from inference.demo.corpus import sample_texts

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)
# Bump when the training recipe changes, so cached tokenizers of the old recipe are not reused.
RECIPE_VERSION = 1
# The smallest vocabulary that holds the 256 byte symbols, the special tokens and some merges.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    min_frequency: int = 2,
    model_max_length: int | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`; `<|endoftext|>` is BOS and EOS, `<|pad|>` pads.

    Deterministic for the same texts in the same order. No prefix space is added, so code keeps
    its exact whitespace and `decode(encode(s)) == s` for every string.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        **extra,
    )


#: Where trained tokenizers are kept between runs unless the caller names another directory
#: (the Django commands pass `inference.conf.conf.CACHE_DIR`, SPECOPS_CACHE_DIR).
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "specops"


def _cache_key(vocab_size: int, sample_chars: int) -> str:
    recipe = {
        "recipe": RECIPE_VERSION,
        "vocab_size": vocab_size,
        "sample_chars": sample_chars,
        "tokenizers": tokenizers.__version__,
        "stdlib": str(Path(os.__file__).parent),
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
    return f"stdlib-bpe-{vocab_size}-{digest[:12]}"


def save_atomically(tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    """Write a tokenizer so that `directory` either holds all its files or does not exist."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        tokenizer.save_pretrained(staging)
        make_shareable(staging)
        try:
            os.replace(staging, directory)
        except OSError:
            if not (directory / "tokenizer.json").is_file():
                raise
            # Another process finished the same tokenizer first; its copy is as good as ours.
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def stdlib_tokenizer(
    vocab_size: int = 1024,
    sample_chars: int = 400_000,
    cache_dir: Path | None = None,
) -> PreTrainedTokenizerFast:
    """Return a tokenizer trained on a small stdlib sample, trained once and then cached on disk.

    Tests build many tiny models; training takes about a second, loading the cached copy
    milliseconds. The cache key covers everything the result depends on. `cache_dir` defaults
    to DEFAULT_CACHE_DIR; this module reads no environment.
    """
    directory = Path(cache_dir or DEFAULT_CACHE_DIR) / "tokenizers" / _cache_key(
        vocab_size, sample_chars
    )
    if not (directory / "tokenizer.json").is_file():
        tokenizer = train_tokenizer(sample_texts(sample_chars), vocab_size=vocab_size)
        save_atomically(tokenizer, directory)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def make_shareable(directory: Path) -> None:
    """Give a staged directory and its files the permissions the umask allows (mkdtemp gives 0700).

    Model directories are read by other processes, possibly under other users (web, workers).
    """
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)
