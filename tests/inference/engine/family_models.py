"""Tiny random target/draft pairs of many Hugging Face families, saved like a user's own checkpoints.

Each family is a config of the real transformers class at a tiny shape (the target 2 layers,
the draft 1 and narrower), written with `save_pretrained` next to one shared byte-level BPE
tokenizer, and loaded back through the engine's loader. Between them they cover what a user's
models bring: full attention, grouped-query and multi-query attention, sliding windows (all
layers, and alternating local/global), a model without SDPA and with soft-capped logits
(Gemma 2), mixture of experts, parallel attention/MLP, learned absolute positions, tied and
untied heads and a vocabulary padded past the tokenizer. The windows (8) are shorter than the
sequences the tests run, so speculative steps cross their edges.

Used by tests/inference/engine/test_family_matrix.py and bench/families.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from inference.demo import corpus
from inference.demo.tokenizer_builder import train_tokenizer

WINDOW = 8
TOKENIZER_VOCAB = 300


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int


TARGET = Shape(layers=2, hidden=64, heads=4, kv_heads=2)
DRAFT = Shape(layers=1, hidden=32, heads=2, kv_heads=1)


def _llama_like(shape: Shape) -> dict[str, Any]:
    return {"hidden_size": shape.hidden, "intermediate_size": 2 * shape.hidden,
            "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "max_position_embeddings": 256}


def _with(**extra: Any) -> Callable[[Shape], dict[str, Any]]:
    """Llama-style fields plus a family's own (a callable value gets the shape)."""
    def fields(shape: Shape) -> dict[str, Any]:
        return _llama_like(shape) | {key: value(shape) if callable(value) else value
                                     for key, value in extra.items()}
    return fields


def _head_dim(shape: Shape) -> int:
    return shape.hidden // shape.heads


# model_type -> (what it exercises, its config fields at a shape)
FAMILIES: dict[str, tuple[str, Callable[[Shape], dict[str, Any]]]] = {
    "llama": ("full attention, GQA, untied head", _with(tie_word_embeddings=False)),
    "mistral": ("sliding window on every layer", _with(sliding_window=WINDOW)),
    "qwen2": ("full then sliding layers (use_sliding_window), padded vocabulary",
              _with(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                    vocab_size=TOKENIZER_VOCAB + 20)),
    "qwen3": ("per-head q/k norm", _with(head_dim=_head_dim)),
    "gemma": ("scaled embeddings, GeGLU", _with(head_dim=_head_dim, tie_word_embeddings=False)),
    "gemma2": ("no SDPA (eager), alternating local/global, soft-capped logits and scores",
               _with(head_dim=_head_dim, sliding_window=WINDOW, final_logit_softcapping=5.0,
                     tie_word_embeddings=False)),
    "gemma3_text": ("alternating local/global (SDPA), q/k norm",
                    _with(head_dim=_head_dim, sliding_window=WINDOW, tie_word_embeddings=False,
                          layer_types=lambda s: ["sliding_attention", "full_attention"][: s.layers])),
    "phi3": ("fused qkv and gate/up projections", _with()),
    "mixtral": ("mixture of experts", _with(num_local_experts=4, num_experts_per_tok=2)),
    "starcoder2": ("sliding window with biases, LayerNorm", _with(sliding_window=WINDOW)),
    "stablelm": ("partial rotary, qkv bias", _with(partial_rotary_factor=0.5, use_qkv_bias=True)),
    "olmo": ("non-parametric LayerNorm", _with()),
    "granite": ("embedding/residual/logit multipliers",
                _with(embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0)),
    "gpt2": ("learned absolute positions, tied head",
             lambda s: {"n_embd": s.hidden, "n_layer": s.layers, "n_head": s.heads, "n_positions": 256}),
    "gpt_neox": ("parallel attention/MLP, partial rotary",
                 lambda s: {"hidden_size": s.hidden, "intermediate_size": 2 * s.hidden,
                            "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
                            "max_position_embeddings": 256, "use_parallel_residual": True,
                            "rotary_pct": 0.5, "tie_word_embeddings": False}),
    "opt": ("learned positions with an offset",
            lambda s: {"hidden_size": s.hidden, "ffn_dim": 2 * s.hidden, "num_hidden_layers": s.layers,
                       "num_attention_heads": s.heads, "max_position_embeddings": 256,
                       "word_embed_proj_dim": s.hidden}),
    "falcon": ("parallel attention, multi-query",
               lambda s: {"hidden_size": s.hidden, "num_hidden_layers": s.layers,
                          "num_attention_heads": s.heads, "max_position_embeddings": 256,
                          "parallel_attn": True, "multi_query": True, "alibi": False, "tie_word_embeddings": False,
                          "new_decoder_architecture": False}),
}


@functools.cache
def shared_tokenizer() -> PreTrainedTokenizerBase:
    """One small byte-level BPE every family's pair shares (trained in well under a second)."""
    return train_tokenizer(corpus.sample_texts(20_000), vocab_size=TOKENIZER_VOCAB)


def family_config(model_type: str, shape: Shape, padded_vocab: bool = True):
    """The family's config at `shape`, its vocabulary the shared tokenizer's (or padded past it)."""
    tokenizer = shared_tokenizer()
    fields = FAMILIES[model_type][1](shape)
    if not padded_vocab:
        fields.pop("vocab_size", None)
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    fields = {"vocab_size": len(tokenizer)} | special | fields
    return AutoConfig.for_model(model_type, **fields)


def save_family_pair(model_type: str, root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Build a random target and draft of `model_type` and save both (with the tokenizer) under `root`.

    The draft's vocabulary is the tokenizer's; a family with a padded vocabulary pads the target only.
    """
    directories = []
    for role, shape, role_seed, padded in (("target", TARGET, seed, True), ("draft", DRAFT, seed + 1, False)):
        directory = root / f"{model_type}-{role}"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(role_seed)
            model = AutoModelForCausalLM.from_config(family_config(model_type, shape, padded))
            with torch.no_grad():  # unit-scale weights: transformers' small init (std 0.02) makes
                for parameter in model.parameters():  # many families repeat one token forever
                    if parameter.dim() >= 2:
                        parameter.normal_(0.0, parameter.shape[-1] ** -0.5)
        model.save_pretrained(directory)
        shared_tokenizer().save_pretrained(directory)
        directories.append(directory)
    return directories[0], directories[1]
