"""Model directories without a network: configs of each family, random init, whole-or-absent saves.

The demo builder and the tests' tiny pairs build models the same way: a config of a family
(GPT-2, Llama, Qwen2) and shape whose vocabulary matches a tokenizer, weights fixed by a seed,
and a `save_pretrained` directory that is complete or absent, with a marker saying which recipe
built it, so a finished directory is reused and a half-written one never seen.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
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

from inference.demo.tokenizer_builder import make_shareable

Arch = Literal["gpt2", "llama", "qwen2"]
ARCHITECTURES: tuple[Arch, ...] = ("gpt2", "llama", "qwen2")
MARKER_FILE = "specops_build.json"


@dataclass(frozen=True)
class ModelShape:
    """The sizes that define a decoder-only transformer, independent of its family."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    context_length: int


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
