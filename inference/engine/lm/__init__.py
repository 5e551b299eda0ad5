"""The language models (``lm``): loading a target/draft pair from local directories, the one place that calls a
transformers forward (lean modeling), the int8/oneDNN linear kernels, and optimised variants.

* ``loading``: `load_causal_lm` / `load_model_pair` (a plain or a variant directory, no network),
  the pair's compatibility checks, `LoadedModel` (model + tokenizer);
* ``modeling``: forwards with a cache, context length, vocabulary widths and alignment;
* ``linear_kernels``: large matmuls on oneDNN where it is faster and bit-identical;
* ``variants`` (a package): int8, bf16 and compiled variants, their recipes and measurement;
  ``variant_writer`` writes a variant directory beside its base.
"""

from inference.engine.lm.linear_kernels import LinearKernels, prepare_kernels, set_linear_kernels
from inference.engine.lm.loading import (
    LoadedModel,
    ModelLoadError,
    check_pair_compatible,
    check_pair_directories,
    decode_of,
    describe_model,
    load_causal_lm,
    load_model_pair,
    load_tokenizer,
    model_context_length,
    unwrap_model,
)
from inference.engine.lm.modeling import (
    SUBSTITUTE_TOKEN_ID,
    align_vocab,
    context_length,
    draftable_ids,
    forward_batch_logits,
    forward_logits,
    input_vocab_size,
    logits_width,
)
from inference.engine.lm.variant_writer import build_variant_dir, variant_dir_for

__all__ = [
    "SUBSTITUTE_TOKEN_ID",
    "LinearKernels",
    "LoadedModel",
    "ModelLoadError",
    "align_vocab",
    "build_variant_dir",
    "check_pair_compatible",
    "check_pair_directories",
    "context_length",
    "decode_of",
    "describe_model",
    "draftable_ids",
    "forward_batch_logits",
    "forward_logits",
    "input_vocab_size",
    "load_causal_lm",
    "load_model_pair",
    "load_tokenizer",
    "logits_width",
    "model_context_length",
    "prepare_kernels",
    "set_linear_kernels",
    "unwrap_model",
    "variant_dir_for",
]
