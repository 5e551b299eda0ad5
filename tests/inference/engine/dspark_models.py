"""Tiny DSpark checkpoints for tests, written in DeepSpec's layout by hand (not by save_dspark).

`deepspec_config` builds config.json as DeepSpec's ``build_draft_config`` does (a copy of the
target's config plus the drafter's fields); `deepspec_weight_names` lists the parameter names of
DeepSpec's ``Qwen3DSparkModel`` module tree, written out here so a renamed module in this
project's model fails the loading test instead of silently agreeing with itself.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from inference.engine.drafters.dspark import DSparkConfig, DSparkModel


def qwen3_target(vocab_size: int = 64, layers: int = 3, seed: int = 5,
                 dtype: torch.dtype = torch.float64) -> PreTrainedModel:
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa")
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
    return model.to(dtype).eval()


def deepspec_config(target: PreTrainedModel, target_layer_ids=(0, 1), block_size: int = 4,
                    markov_rank: int = 8, mask_token_id: int | None = None,
                    markov_head_type: str = "vanilla", draft_layers: int = 1) -> dict:
    raw = target.config.to_dict()
    raw.update(
        architectures=["Qwen3DSparkModel"], model_type="qwen3",
        num_target_layers=target.config.num_hidden_layers, num_hidden_layers=draft_layers,
        block_size=block_size, tie_word_embeddings=False, layer_types=["full_attention"] * draft_layers,
        mask_token_id=target.config.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=list(target_layer_ids), num_anchors=512, enable_confidence_head=True,
        confidence_head_with_markov=bool(markov_rank), markov_rank=markov_rank,
    )
    text = target.config.get_text_config(decoder=True)
    heads = int(text.num_attention_heads)
    # a target outside the Llama family (GPT-2) names its sizes otherwise: the backbone's own fields
    raw.update(hidden_size=int(text.hidden_size), num_attention_heads=heads,
               num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
               intermediate_size=int(getattr(text, "intermediate_size", None) or 2 * text.hidden_size),
               max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 512),
               vocab_size=int(target.get_input_embeddings().weight.shape[0]))
    raw.setdefault("head_dim", int(text.hidden_size) // heads)
    raw.setdefault("rms_norm_eps", 1e-6)
    if markov_rank:
        raw["markov_head_type"] = markov_head_type
    raw.pop("torch_dtype", None)
    raw.pop("dtype", None)
    return raw


def deepspec_weight_names(draft_layers: int, markov_rank: int, gated: bool = False) -> set[str]:
    names = {"embed_tokens.weight", "norm.weight", "fc.weight", "hidden_norm.weight", "lm_head.weight",
             "confidence_head.proj.weight", "confidence_head.proj.bias"}
    for layer in range(draft_layers):
        prefix = f"layers.{layer}."
        names |= {prefix + name for name in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight")}
    if markov_rank:
        names |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
        if gated:
            names |= {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"}
    return names


def write_deepspec_checkpoint(directory: Path, target: PreTrainedModel, seed: int = 7,
                              confidence_bias: float | None = None, **config_kwargs) -> Path:
    """A random DSpark checkpoint for `target` in DeepSpec's layout (embedding and head copied).

    confidence_bias: set the confidence head's bias (e.g. 8: every position looks safe, so a
    verification scheduler admits the drafts of this random drafter)."""
    raw = deepspec_config(target, **config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DSparkModel(DSparkConfig.from_dict(raw))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.lm_head.weight.copy_(target.get_output_embeddings().weight)
        if confidence_bias is not None:
            model.confidence_head.proj.weight.zero_()
            model.confidence_head.proj.bias.fill_(confidence_bias)
    state = {name: tensor.detach().float().contiguous() for name, tensor in model.state_dict().items()}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return directory
