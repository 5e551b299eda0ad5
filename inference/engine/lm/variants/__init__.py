"""Optimised variants of a saved model: int8 dynamic quantisation, bf16, torch.compile.

A variant directory sits beside its base (``demo-draft`` -> ``demo-draft.int8``) and holds the
base's config and tokenizer files plus its recipe; ``load_causal_lm`` reads the recipe and rebuilds
the variant, so a variant directory is loaded like any model directory (by the worker, the
benches, the tests). The parts:

* ``recipes``: the recipe file (``specops_variant.json``), its kinds and options, the base's
  weights digest that refuses a changed base;
* ``int8_linear``: the int8 kernel (`Int8Linear`, per-token activation scales) and its digest;
* ``transforms``: a loaded base made into the variant a recipe describes (`apply_variant`);
* ``measurement``: the figures a build records (size, forward latency, top-1 agreement).

Writing a variant directory is ``inference.engine.lm.variant_writer`` (it loads the base
through ``load_causal_lm``, which imports this package). Storage, by kind:

* ``bf16``: the weights themselves, saved by ``save_pretrained`` in bfloat16 (half the size).
* ``int8``: no weights. Dynamic quantisation is a deterministic function of the fp32 weights
  (per-channel scales from each row's max |w|), and it takes well under a second for the demo
  pair, so the variant keeps a reference to the base directory and re-quantises at load; the
  recipe's ``weights_digest`` is checked against the result, so a changed base or a torch whose
  quantiser rounds differently is refused rather than served silently. A saved quantised
  state_dict would tie the file to torch's packed-parameter format (deprecated ``torch.ao``
  internals) and still need the fp32 module tree rebuilt and quantised before loading it.
* ``compiled``: no weights either; ``torch.compile`` happens at load (lazily, at the first
  forward of each shape), which is the only place a compiled graph can live.
"""

from inference.engine.lm.variants.int8_linear import Int8Linear, int8_weights_digest, quantize_int8
from inference.engine.lm.variants.measurement import (
    forward_ms,
    measure_variant,
    model_size_bytes,
    top1_agreement,
)
from inference.engine.lm.variants.recipes import (
    RECIPE_VERSION,
    VARIANT_FILE,
    VARIANT_KINDS,
    VariantError,
    VariantRecipe,
    check_source,
    default_options,
    directory_digest,
    read_recipe,
    weight_files,
)
from inference.engine.lm.variants.transforms import apply_variant, compile_forward, to_bf16

__all__ = [
    "RECIPE_VERSION",
    "VARIANT_FILE",
    "VARIANT_KINDS",
    "Int8Linear",
    "VariantError",
    "VariantRecipe",
    "apply_variant",
    "check_source",
    "compile_forward",
    "default_options",
    "directory_digest",
    "forward_ms",
    "int8_weights_digest",
    "measure_variant",
    "model_size_bytes",
    "quantize_int8",
    "read_recipe",
    "to_bf16",
    "top1_agreement",
    "weight_files",
]
