"""Tiny random target/draft pairs for tests, built in seconds.

The weights are random, but everything else is real: a byte-level BPE tokenizer trained on the
standard library, `save_pretrained` directories, and loading through `AutoModelForCausalLM`. So
tests exercise the same code path as production models, for each architecture family the engine
supports (GPT-2, Llama, Qwen2), including grouped-query attention for the latter two.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

from inference.demo.tokenizer_builder import make_shareable, stdlib_tokenizer

Arch = Literal["gpt2", "llama", "qwen2"]
ARCHITECTURES: tuple[Arch, ...] = ("gpt2", "llama", "qwen2")
MARKER_FILE = "specops_build.json"
# Bump when the recipe below changes, so directories built by the old recipe are rebuilt.
TINY_RECIPE_VERSION = 1


@dataclass(frozen=True)
class ModelShape:
    """The sizes that define a decoder-only transformer, independent of its family."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    context_length: int


TINY_TARGET = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128,
                         context_length=1024)
TINY_DRAFT = ModelShape(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64,
                        context_length=1024)
TINY_VOCAB_SIZE = 1024


def causal_lm_config(
    arch: Arch, shape: ModelShape, tokenizer: PreTrainedTokenizerBase
) -> PretrainedConfig:
    """Build a config of the given family and shape whose vocabulary matches `tokenizer`."""
    special = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch == "gpt2":
        return GPT2Config(
            n_layer=shape.layers,
            n_embd=shape.hidden,
            n_head=shape.heads,
            n_inner=shape.intermediate,
            n_positions=shape.context_length,
            # No dropout: training stays a pure function of the seed (and eval ignores it anyway).
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **special,
        )
    families = {"llama": LlamaConfig, "qwen2": Qwen2Config}
    if arch not in families:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    return families[arch](
        num_hidden_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.context_length,
        tie_word_embeddings=True,
        **special,
    )


def random_causal_lm(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """Initialise a model from `config` with weights fixed by `seed`, in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.eval()


def read_marker(directory: Path) -> dict | None:
    """Return the build marker of a model directory, or None if it is absent or unreadable."""
    try:
        return json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_complete(directory: Path, marker: dict) -> bool:
    """A model directory is reusable when it was saved whole by the same recipe and seed."""
    return (directory / "config.json").is_file() and read_marker(directory) == marker


def save_model_dir(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    directory: Path,
    marker: dict,
) -> None:
    """Save model, tokenizer and marker so `directory` is complete or absent, never half-written."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True))
        make_shareable(staging)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_tiny_pair(
    out_dir: str | os.PathLike[str],
    arch: Arch = "gpt2",
    seed: int = 0,
) -> tuple[Path, Path]:
    """Build (or reuse) a tiny random target and a smaller random draft sharing one tokenizer.

    Returns `(target_dir, draft_dir)` under `out_dir`. The target has 2 layers, the draft 1 and
    half the width, so the draft is measurably cheaper, as in a real pair. Weights are random, so
    the draft agrees with the target only by chance: use these pairs for correctness, not speed.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    root = Path(out_dir)
    tokenizer = stdlib_tokenizer(vocab_size=TINY_VOCAB_SIZE)
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
