"""Tiny random target/draft pairs for tests, built in seconds.

The weights are random, but everything else is real: a byte-level BPE tokenizer trained on the
standard library, `save_pretrained` directories, and loading through `AutoModelForCausalLM`. So
tests exercise the same code path as production models, for each architecture family the engine
supports (GPT-2, Llama, Qwen2), including grouped-query attention for the latter two.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from inference.demo.corpus import sample_texts
from inference.demo.model_files import (
    ARCHITECTURES,
    MARKER_FILE,
    Arch,
    ModelShape,
    causal_lm_config,
    is_complete,
    random_causal_lm,
    read_marker,
    save_model_dir,
)
from inference.demo.tokenizer_builder import stdlib_tokenizer, train_tokenizer

__all__ = ["ARCHITECTURES", "MARKER_FILE", "TINY_DRAFT", "TINY_TARGET", "TINY_VOCAB_SIZE", "Arch",
           "ModelShape", "build_foreign_draft", "build_tiny_pair", "causal_lm_config", "is_complete",
           "random_causal_lm", "read_marker", "save_model_dir"]

# Bump when the recipe below changes, so directories built by the old recipe are rebuilt.
TINY_RECIPE_VERSION = 1

TINY_TARGET = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128,
                         context_length=1024)
TINY_DRAFT = ModelShape(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64,
                        context_length=1024)
TINY_VOCAB_SIZE = 1024


def build_tiny_pair(
    out_dir: str | os.PathLike[str],
    arch: Arch = "gpt2",
    seed: int = 0,
    cache_dir: Path | None = None,
) -> tuple[Path, Path]:
    """Build (or reuse) a tiny random target and a smaller random draft sharing one tokenizer.

    Returns `(target_dir, draft_dir)` under `out_dir`. The target has 2 layers, the draft 1 and
    half the width, so the draft is measurably cheaper, as in a real pair. Weights are random, so
    the draft agrees with the target only by chance: use these pairs for correctness, not speed.
    `cache_dir` keeps the trained tokenizer (default ~/.cache/specops).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    root = Path(out_dir)
    tokenizer = stdlib_tokenizer(vocab_size=TINY_VOCAB_SIZE, cache_dir=cache_dir)
    dirs = []
    for role, shape, role_seed in (("target", TINY_TARGET, seed), ("draft", TINY_DRAFT, seed + 1)):
        directory = root / f"tiny-{arch}-{role}"
        marker = {
            "kind": "tiny",
            "recipe": TINY_RECIPE_VERSION,
            "arch": arch,
            "role": role,
            "seed": seed,
            "shape": asdict(shape),
            "vocab_size": len(tokenizer),
        }
        if not is_complete(directory, marker):
            model = random_causal_lm(causal_lm_config(arch, shape, tokenizer), role_seed)
            save_model_dir(model, tokenizer, directory, marker)
        dirs.append(directory)
    return dirs[0], dirs[1]


def build_foreign_draft(directory: str | os.PathLike[str], arch: Arch = "qwen2") -> Path:
    """A tiny random draft whose tokenizer is not the tiny pairs' one (300 tokens, another sample):
    a pair with it must be refused wherever a drafter's pair is checked."""
    tokenizer = train_tokenizer(sample_texts(20_000), vocab_size=300)
    model = random_causal_lm(causal_lm_config(arch, TINY_DRAFT, tokenizer), seed=0)
    save_model_dir(model, tokenizer, Path(directory), marker={"kind": "foreign-draft"})
    return Path(directory)
