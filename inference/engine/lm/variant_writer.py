"""Write a variant directory beside its base (the loading side is ``variants`` + ``loading``).

Outside the ``variants`` package because writing loads the base through ``load_causal_lm``, which
itself reads variant recipes: the package stays importable by the loader without a cycle.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from inference.engine.lm.loading import load_causal_lm
from inference.engine.lm.variants.int8_linear import int8_weights_digest
from inference.engine.lm.variants.recipes import (
    VARIANT_FILE,
    VARIANT_KINDS,
    VariantError,
    VariantRecipe,
    default_options,
    directory_digest,
    read_recipe,
    weight_files,
)
from inference.engine.lm.variants.transforms import apply_variant, to_bf16


def variant_dir_for(base_dir: Path, kind: str) -> Path:
    """Where the ``kind`` variant of ``base_dir`` lives: beside it, ``<base>.<kind>``."""
    return base_dir.parent / f"{base_dir.name}.{kind}"


def build_variant_dir(base_dir: str | os.PathLike[str], kind: str, role: str = "target",
                      options: dict[str, Any] | None = None,
                      out_dir: str | os.PathLike[str] | None = None) -> tuple[Path, VariantRecipe]:
    """Write the ``kind`` variant of the model in ``base_dir``; reuse one already built the same way.

    The directory appears whole or not at all (written in a staging directory, then renamed).
    Returns the variant directory and its recipe.
    """
    base = Path(base_dir).resolve()
    if kind not in VARIANT_KINDS:
        raise VariantError(f"kind must be one of {', '.join(VARIANT_KINDS)}, not {kind!r}")
    if read_recipe(base) is not None:
        raise VariantError(f"{base} is itself a variant; build variants from the original model")
    if not (base / "config.json").is_file():
        raise VariantError(f"{base} is not a model directory (no config.json)")
    target = Path(out_dir).resolve() if out_dir is not None else variant_dir_for(base, kind)
    options = {**default_options(kind, role), **(options or {})}
    source_digest = directory_digest(base)
    existing = read_recipe(target) if target.is_dir() else None
    if (existing is not None and existing.options == options and existing.source_digest == source_digest
            and existing.torch_version == torch.__version__):
        return target, existing
    weights_digest = None
    loaded = load_causal_lm(base) if kind in ("int8", "bf16") else None
    if kind == "int8":
        probe = VariantRecipe(kind, os.path.relpath(base, target), source_digest, options)
        weights_digest = int8_weights_digest(apply_variant(loaded.model, probe))
    source = "." if kind == "bf16" else os.path.relpath(base, target)
    recipe = VariantRecipe(kind=kind, source=source, source_digest=source_digest, options=options,
                           weights_digest=weights_digest)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        if kind == "bf16":
            to_bf16(loaded.model).save_pretrained(staging)
            loaded.tokenizer.save_pretrained(staging)
        else:
            for path in base.iterdir():
                if path.is_file() and path not in weight_files(base):
                    shutil.copy2(path, staging / path.name)
        (staging / VARIANT_FILE).write_text(json.dumps(recipe.to_json(), indent=2, sort_keys=True))
        for path in [staging, *staging.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target, recipe
