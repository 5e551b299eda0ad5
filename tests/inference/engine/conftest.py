"""Tiny random GPT-2 / Llama / Qwen2 models built straight from configs, in well under a second.

Models are built once per process (functools.cache), so hypothesis tests can use them without
function-scoped fixtures. float64 by default: speculative verification scores several tokens
in one forward and the target-only loop one at a time, and in float32 a random model's near-tied
logits can flip an argmax between the two; float64 keeps the comparison about the algorithm.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

ARCHS = ("gpt2", "llama", "qwen2")
VOCAB_SIZE = 96
CONTEXT = 128


@pytest.fixture(scope="session", autouse=True)
def single_thread_torch():
    """One intra-op thread: the models are tiny, and on a shared 2-core machine a second
    thread spinning against other processes makes each forward ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(arch: str, vocab_size: int, hidden: int, layers: int, context: int):
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=4,
                          n_positions=context, bos_token_id=0, eos_token_id=1,
                          tie_word_embeddings=False)
    family = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[arch]
    return family(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=context, bos_token_id=0, eos_token_id=1,
                  tie_word_embeddings=False, **_FAMILY_EXTRAS.get(arch, lambda hidden: {})(hidden))


# Fields a family needs beyond the shared ones: Qwen3's head size is its own (default 128), and
# Mistral's window is left off (the lean path refuses a sliding window).
_FAMILY_EXTRAS = {"qwen3": lambda hidden: {"head_dim": hidden // 4}, "mistral": lambda hidden: {"sliding_window": None}}


def _build(arch: str, seed: int, dtype: torch.dtype, vocab_size: int, hidden: int, layers: int,
           context: int, logit_scale: float) -> PreTrainedModel:
    cls = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM,
           "qwen3": Qwen3ForCausalLM, "mistral": MistralForCausalLM}[arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls._from_config(_config(arch, vocab_size, hidden, layers, context),
                                 attn_implementation="sdpa")
        # Random init gives near-uniform outputs; a sharper head makes drafts agree sometimes
        # and exercises acceptance as well as rejection.
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(logit_scale)
    return model.to(dtype).eval()


@functools.cache
def target_model(arch: str, dtype: torch.dtype = torch.float64, vocab_size: int = VOCAB_SIZE,
                 context: int = CONTEXT) -> PreTrainedModel:
    return _build(arch, 1, dtype, vocab_size, 64, 2, context, logit_scale=8.0)


@functools.cache
def draft_model(arch: str, dtype: torch.dtype = torch.float64, vocab_size: int = VOCAB_SIZE,
                context: int = CONTEXT) -> PreTrainedModel:
    """A smaller random model of the same family: agrees with the target only by chance."""
    return _build(arch, 2, dtype, vocab_size, 32, 1, context, logit_scale=8.0)


@functools.cache
def noisy_copy(arch: str, noise: float = 0.1, dtype: torch.dtype = torch.float64,
               vocab_size: int = VOCAB_SIZE, context: int = CONTEXT) -> PreTrainedModel:
    """The target with weights perturbed by `noise` x their spread: agrees often, not always."""
    target = target_model(arch, dtype, vocab_size, context)
    copy = _build(arch, 1, dtype, vocab_size, 64, 2, context, logit_scale=8.0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for source, parameter in zip(target.parameters(), copy.parameters()):
            scale = noise * float(source.std()) if source.numel() > 1 else 0.0
            parameter.copy_(source + scale * torch.randn(source.shape, generator=generator,
                                                         dtype=source.dtype))
    return copy
