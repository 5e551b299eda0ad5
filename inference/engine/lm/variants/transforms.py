"""Turn a loaded base model into the variant its recipe describes: int8, bf16 or compiled."""

from __future__ import annotations

import torch
from torch import nn

from inference.engine.lm.variants.int8_linear import int8_weights_digest, quantize_int8
from inference.engine.lm.variants.recipes import VariantError, VariantRecipe


def to_bf16(model: nn.Module) -> nn.Module:
    """The model in bfloat16, in place (a bf16 variant is saved this way at build)."""
    return model.to(torch.bfloat16)


def compile_forward(model: nn.Module, backend: str = "inductor", dynamic: bool = True) -> nn.Module:
    """``torch.compile`` each decoder layer and the head, in place.

    Layers, not ``model.forward``: the engine's lean Llama path calls the layers and the head
    directly, and compiling the one layer class gives one graph that every layer reuses.
    """
    layers = _decoder_layers(model)
    if not layers:
        raise VariantError(f"{type(model).__name__}: cannot find its decoder layers to compile")
    import torch._dynamo.config as dynamo_config

    # each layer's `layer_idx` would otherwise be a constant of its graph: one graph per layer and
    # shape, and past dynamo's recompile limit (8 per code object, kept: on 2 cores each graph
    # costs ~15 s to build) the rest run eagerly. A process-wide setting, as torch has it.
    dynamo_config.allow_unspec_int_on_nn_module = True
    for layer in layers:
        layer.compile(backend=backend, dynamic=dynamic)
    head = model.get_output_embeddings()
    if head is not None:
        head.compile(backend=backend, dynamic=dynamic)
    return model


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    for name in ("layers", "h"):
        layers = getattr(inner, name, None)
        if isinstance(layers, nn.ModuleList):
            return list(layers)
    return []


def apply_variant(model: nn.Module, recipe: VariantRecipe) -> nn.Module:
    """Turn a loaded base model into the variant ``recipe`` describes (bf16 is loaded as such)."""
    options = recipe.options
    if recipe.kind == "int8":
        quantize_int8(model, per_token=options.get("activations", "per_token") == "per_token",
                      per_channel=options.get("weights", "per_channel") == "per_channel",
                      head=options.get("head", True))
        if recipe.weights_digest is not None and int8_weights_digest(model) != recipe.weights_digest:
            raise VariantError("the int8 weights quantised at load differ from those recorded at build "
                               f"(torch {recipe.torch_version} then, {torch.__version__} now); rebuild the variant")
    elif recipe.kind == "bf16":
        to_bf16(model)
    elif recipe.kind == "compiled":
        compile_forward(model, backend=options.get("backend", "inductor"), dynamic=options.get("dynamic", True))
    return model
