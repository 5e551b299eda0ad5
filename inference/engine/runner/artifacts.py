"""Compiled forwards on disk: AOTInductor packages, built once per architecture and loaded in milliseconds.

A package is `torch.export` of a `StaticForward` (static_forward.py), compiled by AOTInductor
into a shared library with every size a symbol (rows, new tokens, cached slots) within the
pool's bounds, so one package serves every bucket of a CPU. Weights are not inside: the runner
hands the loaded model's own tensors to the package (`load_constants(..., user_managed=True)`),
so a package is a function of the architecture alone and two versions of one architecture share
it. Its key says everything the compiled code depends on: the model's config and dtype, the
graph's kind and feature taps, the pool's geometry (its strides are compiled in), the torch
version, the device, and this package's own source (a change of the forward is a new key).

Building costs a minute or more of two CPU cores, so it happens in a process of its own
(builder.py) while the eager forward serves; a package is written to a temporary name and
renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from inference.engine.runner.kv_pool import KVPool, PoolShape
from inference.engine.runner.static_forward import LOGITS_LAST, StaticForward

logger = logging.getLogger(__name__)

_SOURCES = ("static_forward.py", "artifacts.py")
# The most rows a compiled forward takes (a bound of its symbol, not memory: pools are sized apart)
MAX_ROWS = 1024


@dataclass(frozen=True)
class GraphSpec:
    """One compiled forward: its logits kind, feature taps and the bounds of its symbolic sizes."""

    kind: str
    taps: tuple[int, ...]
    capacity: int
    max_tokens: int


def sources_digest(paths: Iterable[Path]) -> str:
    """A digest of source files: a package built from other code has another key."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def _source_digest() -> str:
    here = Path(__file__).resolve().parent
    return sources_digest(here / name for name in _SOURCES)


def architecture_digest(model: PreTrainedModel) -> str:
    """The config and dtype: what a package's code depends on (weights are loaded at run time)."""
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures"):
        config.pop(volatile, None)
    text = json.dumps(config, sort_keys=True, default=str) + str(model.dtype)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def device_tag(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda{major}{minor}"
    return device.type


def artifact_name(model: PreTrainedModel, spec: GraphSpec) -> str:
    """The package's file name: every input of the compiled code, hashed."""
    key = json.dumps({"arch": architecture_digest(model), "spec": asdict(spec), "torch": torch.__version__,
                      "device": device_tag(model.device), "source": _source_digest()}, sort_keys=True)
    return f"{model.config.model_type}-{spec.kind}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt2"


def example_inputs(model: PreTrainedModel, spec: GraphSpec) -> tuple[torch.Tensor | None, ...]:
    """Inputs to trace with: 2 rows x 3 new tokens over 5 cached slots, the cache a view of a real
    pool of the spec's capacity (so the traced strides are every such pool's)."""
    device = model.device
    rows, new, width = 2, 3, 5
    pool = KVPool(PoolShape.of(model), rows, spec.capacity, device)
    dtype = model.dtype
    keys, values = pool.view(rows, width)
    inputs = [torch.ones(rows, new, dtype=torch.long, device=device),
              torch.arange(width, width + new, device=device)[None].expand(rows, new).contiguous(),
              torch.zeros(rows, 1, new, width, dtype=dtype, device=device),
              torch.zeros(rows, 1, new, new, dtype=dtype, device=device), keys, values]
    windowed = StaticForward(model, spec.kind, spec.taps).windowed
    inputs += [inputs[2].clone(), inputs[3].clone()] if windowed else [None, None]
    last = torch.full((rows,), new - 1, dtype=torch.long, device=device)
    inputs.append(last if spec.kind == LOGITS_LAST else None)
    return tuple(inputs)


def dynamic_shapes(spec: GraphSpec, windowed: bool) -> tuple:
    """Rows, new tokens and cached slots as symbols bounded by the pool (export's Dims)."""
    rows = torch.export.Dim("rows", min=1, max=MAX_ROWS)
    new = torch.export.Dim("new", min=1, max=spec.max_tokens)
    # below the capacity: a view of every slot would be another case to the tracer (a forward
    # always leaves room for its new tokens, so it never reads them all)
    slots = torch.export.Dim("slots", min=1, max=spec.capacity - 1)
    shapes = [{0: rows, 1: new}, {0: rows, 1: new}, {0: rows, 2: new, 3: slots}, {0: rows, 2: new, 3: new},
              {0: rows, 3: slots}, {0: rows, 3: slots}]
    shapes += [{0: rows, 2: new, 3: slots}, {0: rows, 2: new, 3: new}] if windowed else [None, None]
    shapes.append({0: rows} if spec.kind == LOGITS_LAST else None)
    return tuple(shapes)


def build_package(model: PreTrainedModel, spec: GraphSpec, path: Path) -> float:
    """Export and compile the forward of `spec` into `path` (atomically); returns the seconds it took.

    Raises what export or the compiler raise: a graph break or an op it cannot lower is the
    caller's cue to serve eagerly.
    """
    forward = StaticForward(model, spec.kind, spec.taps).eval()
    return export_and_package(forward, example_inputs(model, spec), dynamic_shapes(spec, forward.windowed), path)


def export_and_package(module: torch.nn.Module, inputs: tuple, shapes: tuple, path: Path) -> float:
    """`torch.export` `module` on `inputs` with symbolic `shapes`, compile it with AOTInductor into
    `path` (written under a temporary name and renamed); the seconds it took. The module's weights
    stay out of the package (the loader hands them over: `CompiledForward`)."""
    started = time.perf_counter()
    with torch.inference_mode():
        # strict=False: trace the Python as it runs (transformers' modules read config attributes);
        # a graph break is still an error, export has no fallback
        exported = torch.export.export(module, inputs, dynamic_shapes=shapes, strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".pt2", dir=path.parent)
    os.close(handle)
    try:
        torch._inductor.aoti_compile_and_package(
            exported, package_path=temporary,
            inductor_configs={"aot_inductor.package_constants_in_so": False})
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return time.perf_counter() - started


class CompiledForward:
    """A loaded package, called with a flat list of tensors, returning a flat list."""

    def __init__(self, path: Path, model: torch.nn.Module) -> None:
        self.path = path
        runner = torch._inductor.aoti_load_package(str(path))
        # the model's own tensors by their names under the traced module (`model.` prefixed): tied
        # weights under each of their names, and buffers left out of the state dict (a rotary
        # embedding's `inv_freq`) too
        owned = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
        named = {f"model.{name}": tensor.detach() for name, tensor in owned.items()}
        wanted = runner.get_constant_fqns()
        missing = [name for name in wanted if name not in named]
        if missing:
            raise RuntimeError(f"{path.name}: constants the model lacks: {missing[:3]}")
        runner.load_constants({name: named[name] for name in wanted}, check_full_update=True, user_managed=True)
        self._run = runner.loader.boxed_run  # the loader itself: no pytree (un)flattening per call

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._run(inputs)
