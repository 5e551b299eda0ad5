"""Optimised variants of a saved model: int8 dynamic quantisation, bf16, torch.compile.

A variant lives in a directory beside its base (``demo-draft`` -> ``demo-draft.int8``) that holds
the base's config and tokenizer files plus ``specops_variant.json``, the recipe: how the variant
is made from the base, the base's weights digest, and for int8 the digest of the quantised
weights (written by ``variant_dirs.build_variant_dir``). ``load_causal_lm`` reads the recipe and
rebuilds the variant, so a variant directory is
loaded like any model directory (by the worker, the benches, the tests).

Storage, by kind:

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

int8 activations: ``torch.ao`` dynamic quantisation picks one activation scale for the whole
input tensor, so a row's output depends on the other rows in the forward (the verified chain, the
other sequences of a batch). For a target that breaks "speculative greedy equals the model's own
greedy" and makes a request's output depend on its neighbours; for a draft it makes seeded
sampling depend on them (never its distribution: every draft is verified). So a target's int8
variant quantises activations per token (`Int8Linear`): every row is scaled to max |x| = 1 and two
rail inputs (+1, -1, against zero weight columns) pin the tensor's range, which makes the
quantiser's parameters the same for every row whatever else is in the tensor. A draft's keeps
plain ``quantize_dynamic`` (``activations="per_tensor"``: cheaper, batch-dependent).
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from inference.engine.errors import EngineError

VARIANT_FILE = "specops_variant.json"
VARIANT_KINDS = ("int8", "bf16", "compiled")
RECIPE_VERSION = 1
#: Files of a model directory that hold weights (not copied into a weight-less variant).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class VariantError(EngineError):
    """A variant cannot be built or loaded (unknown kind, missing base, changed weights)."""


@dataclass(frozen=True)
class VariantRecipe:
    """How a variant is made from its base: what ``specops_variant.json`` holds."""

    kind: str
    #: the directory holding the weights, relative to the variant directory ("." for bf16)
    source: str
    #: sha256 of the base directory's weight files when the variant was built
    source_digest: str
    options: dict[str, Any] = field(default_factory=dict)
    #: int8: sha256 of the quantised weights, checked when the variant is rebuilt at load
    weights_digest: str | None = None
    torch_version: str = torch.__version__
    recipe_version: int = RECIPE_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VariantRecipe:
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        if known.get("kind") not in VARIANT_KINDS or "source" not in known:
            raise VariantError(f"not a variant recipe (kind must be one of {', '.join(VARIANT_KINDS)})")
        return cls(**known)

    def source_dir(self, variant_dir: Path) -> Path:
        return (variant_dir / self.source).resolve()

    @property
    def load_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.kind == "bf16" else None


def default_options(kind: str, role: str = "target") -> dict[str, Any]:
    """The recipe options of a kind (the same for both roles; ``role`` is recorded only)."""
    if kind == "int8":
        # a target needs per-token activations (its greedy output must not depend on what else
        # is in the forward); a draft's proposals are verified, so it takes the cheaper kernel
        activations = "per_token" if role == "target" else "per_tensor"
        return {"method": "torch.ao.quantization.quantize_dynamic", "dtype": "qint8",
                "weights": "per_channel", "activations": activations, "modules": ["Linear", "Conv1D"],
                "head": True, "role": role}
    if kind == "bf16":
        return {"dtype": "bfloat16", "role": role}
    if kind == "compiled":
        return {"backend": "inductor", "dynamic": True, "scope": "decoder layers and head", "role": role}
    raise VariantError(f"kind must be one of {', '.join(VARIANT_KINDS)}, not {kind!r}")


# ----------------------------------------------------------------------------- int8


def _dynamic_qconfig(per_channel: bool):
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig

    return per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig


def _quantize(linear: nn.Linear, per_channel: bool) -> nn.Module:
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch.ao's deprecation notices, once per layer
        warnings.simplefilter("ignore")
        return quantize_dynamic(nn.Sequential(linear), {nn.Linear: _dynamic_qconfig(per_channel)},
                                dtype=torch.qint8)[0]


class Int8Linear(nn.Linear):
    """A Linear whose matmul runs in int8 (fbgemm dynamic quantisation), still an nn.Linear.

    It stays an ``nn.Linear`` with a ``weight`` (dequantised, read-only) so the engine's checks
    (the logits width, the lean Llama forward) treat it like the layer it replaces.
    ``per_token``: see the module docstring; each row of the output is a function of that row
    of the input alone.
    """

    def __init__(self, linear: nn.Linear, per_token: bool = True, per_channel: bool = True) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.per_token = per_token
        weight = linear.weight.detach().float()
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        if per_token:  # two zero columns against the +1/-1 rail inputs
            weight = torch.cat((weight, weight.new_zeros(self.out_features, 2)), dim=1)
        inner = nn.Linear(weight.shape[1], self.out_features, bias=bias is not None and not per_token)
        with torch.no_grad():
            inner.weight.copy_(weight)
            if inner.bias is not None:
                inner.bias.copy_(bias)
        self.inner = _quantize(inner, per_channel)
        self.bias = nn.Parameter(bias, requires_grad=False) if per_token and bias is not None else None
        self.register_buffer("rails", torch.tensor((1.0, -1.0)), persistent=False)

    @property
    def weight(self) -> torch.Tensor:  # [out_features, in_features], dequantised
        return self.inner.weight().dequantize()[:, : self.in_features]

    def forward(
        self,
        # [..., in_features]
        x: torch.Tensor,
    ) -> torch.Tensor:
        packed, reduce_range = self.inner._packed_params._packed_params, True  # as torch.ao calls it
        work = x if x.dtype == torch.float32 else x.float()
        if not self.per_token:
            out = torch.ops.quantized.linear_dynamic(work, packed, reduce_range)
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        # [..., 1]: each row's max |x|, so every row is quantised on its own range
        scale = torch.linalg.vector_norm(work, ord=float("inf"), dim=-1, keepdim=True).clamp_min_(1e-30)
        scaled = work.new_empty(*work.shape[:-1], self.in_features + 2)
        torch.div(work, scale, out=scaled[..., : self.in_features])
        scaled[..., self.in_features:] = self.rails
        out = torch.ops.quantized.linear_dynamic(scaled, packed, reduce_range).mul_(scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None or self.inner.bias() is not None}, per_token={self.per_token}")


def _conv1d_as_linear(module: nn.Module) -> nn.Linear:
    """GPT-2's Conv1D (weight [in, out], y = x W + b) as the equivalent nn.Linear."""
    weight = module.weight.detach()
    linear = nn.Linear(weight.shape[0], weight.shape[1], bias=module.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        if module.bias is not None:
            linear.bias.copy_(module.bias.detach())
    return linear


def _is_linear(module: nn.Module) -> bool:
    return (type(module) is nn.Linear) or type(module).__name__ == "Conv1D"


def quantize_int8(model: nn.Module, per_token: bool = True, per_channel: bool = True,
                  head: bool = True) -> nn.Module:
    """Replace every Linear (and GPT-2 Conv1D) of ``model`` by an `Int8Linear`, in place.

    The input embedding stays float (a lookup, not a matmul); ``head=False`` keeps the output
    layer float too. Refuses a model with nothing to quantise, or one off the CPU (fbgemm).
    """
    if next(model.parameters()).device.type != "cpu":
        raise VariantError("int8 dynamic quantisation runs on the CPU only (fbgemm)")
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _is_linear(child) or (child is output and not head):
                continue
            linear = child if isinstance(child, nn.Linear) else _conv1d_as_linear(child)
            setattr(parent, name, Int8Linear(linear.float(), per_token=per_token, per_channel=per_channel))
            replaced += 1
    if replaced == 0:
        raise VariantError(f"{type(model).__name__} has no Linear layers to quantise")
    return model


def int8_weights_digest(model: nn.Module) -> str:
    """sha256 of every quantised weight (int8 values, scales, zero points) and bias, in order."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        if not isinstance(module, Int8Linear):
            continue
        qweight = module.inner.weight()
        digest.update(name.encode())
        digest.update(qweight.int_repr().contiguous().numpy().tobytes())
        if qweight.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            scales, zeros = qweight.q_per_channel_scales(), qweight.q_per_channel_zero_points()
        else:
            scales, zeros = torch.tensor([qweight.q_scale()]), torch.tensor([qweight.q_zero_point()])
        digest.update(scales.double().numpy().tobytes())
        digest.update(zeros.long().numpy().tobytes())
        bias = module.bias if module.bias is not None else module.inner.bias()
        if bias is not None:
            digest.update(bias.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------- bf16, compiled


def to_bf16(model: nn.Module) -> nn.Module:
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


# ----------------------------------------------------------------------------- directories


def read_recipe(directory: str | os.PathLike[str]) -> VariantRecipe | None:
    """The recipe of a variant directory; None for a plain model directory."""
    path = Path(directory) / VARIANT_FILE
    if not path.is_file():
        return None
    try:
        return VariantRecipe.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as error:
        raise VariantError(f"{path} is not a readable variant recipe: {error}") from error


def weight_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and
                  (p.suffix in _WEIGHT_SUFFIXES or p.name in _WEIGHT_INDEXES))


def directory_digest(directory: Path) -> str:
    """sha256 over the weight files of a model directory (names and bytes)."""
    digest = hashlib.sha256()
    files = weight_files(directory)
    if not files:
        raise VariantError(f"{directory} holds no weight files")
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def check_source(recipe: VariantRecipe, variant_dir: Path) -> Path:
    """The base directory of a weight-less variant, refused if missing or changed since the build."""
    source = recipe.source_dir(variant_dir)
    if recipe.source == ".":
        return source
    if not (source / "config.json").is_file():
        raise VariantError(f"variant {variant_dir}: its base model directory {source} is missing")
    if directory_digest(source) != recipe.source_digest:
        raise VariantError(f"variant {variant_dir}: the weights in {source} changed since the variant "
                           "was built; rebuild it")
    return source


# ----------------------------------------------------------------------------- figures


def model_size_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as torch serialises them (shared tensors once, int8 packed)."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(model.state_dict(), buffer)
    return buffer.tell()


def forward_ms(model: nn.Module, tokens: int, context: int = 64, repeats: int = 20) -> float:
    """Median milliseconds of one cached forward of ``tokens`` new tokens after ``context`` tokens."""
    from transformers import DynamicCache

    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(vocab, (1, context), generator=generator)
    new = torch.randint(vocab, (1, tokens), generator=generator)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 2):
            cache = DynamicCache()
            model(input_ids=prefix, cache=cache, use_cache=True)
            started = time.perf_counter()
            model(input_ids=new, cache=cache, use_cache=True)
            times.append(time.perf_counter() - started)
    times = sorted(times[2:])
    return 1000.0 * times[len(times) // 2]


def top1_agreement(reference: nn.Module, variant: nn.Module, prompts: Iterable[list[int]]) -> tuple[float, int]:
    """Share of positions where the variant's argmax equals the reference's, teacher-forced over
    ``prompts`` (one forward each); returns (agreement, positions)."""
    agree = total = 0
    with torch.inference_mode():
        for prompt in prompts:
            if len(prompt) < 2:
                continue
            ids = torch.tensor([prompt])
            expected = reference(input_ids=ids).logits[0].argmax(-1)
            got = variant(input_ids=ids).logits[0].argmax(-1)
            agree += int((expected == got).sum())
            total += len(prompt)
    return (agree / total if total else float("nan")), total


def measure_variant(base: nn.Module, variant: nn.Module, prompts: list[list[int]]) -> dict[str, Any]:
    """The figures a build records: size, forward latency at 1 and 5 new tokens, agreement.

    Timed on one thread: on a shared CPU a second spinning thread makes small forwards erratic.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(base, variant, prompts)
    finally:
        torch.set_num_threads(threads)


def _measure(base: nn.Module, variant: nn.Module, prompts: list[list[int]]) -> dict[str, Any]:
    agreement, positions = top1_agreement(base, variant, prompts)
    return {
        "threads": 1,
        "size_bytes": model_size_bytes(variant),
        "base_size_bytes": model_size_bytes(base),
        "forward_ms_1": round(forward_ms(variant, 1), 3),
        "forward_ms_5": round(forward_ms(variant, 5), 3),
        "base_forward_ms_1": round(forward_ms(base, 1), 3),
        "base_forward_ms_5": round(forward_ms(base, 5), 3),
        "top1_agreement_with_base": round(agreement, 4),
        "agreement_positions": positions,
    }


def clone_model(model: nn.Module) -> nn.Module:
    """A deep copy to transform while keeping the original (tests, benches)."""
    return copy.deepcopy(model)
