"""What a variant is: its recipe (``specops_variant.json``) and the base directory it points at.

A variant lives in a directory beside its base (``demo-draft`` -> ``demo-draft.int8``) that holds
the base's config and tokenizer files plus ``specops_variant.json``, the recipe: how the variant
is made from the base, the base's weights digest, and for int8 the digest of the quantised
weights (written by ``inference.engine.lm.variant_writer``). Reading a recipe and checking
its base is all the loader needs before it applies the recipe (``transforms``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from inference.engine.errors import EngineError
from inference.engine.model_files import VARIANT_FILE

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
