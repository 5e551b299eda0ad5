"""Build an optimised variant of a registered version and register it beside its base.

Shared by ``manage.py build_variants`` and the registry admin's actions. The torch side (how a
variant is made, stored and loaded) is ``inference.engine.lm.variants`` and the directory is
written by ``inference.engine.lm.variant_writer``; this module records the
result: a ModelVersion ``<version>+<kind>`` with ``base``, ``recipe`` and the figures measured at
build (size, forward latency at 1 and 5 new tokens, top-1 agreement with the base on held-out
prompts). The variant stays staged until someone promotes it.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from django.db import transaction
from django.utils import timezone

from inference.conf import conf
from inference.engine.lm.loading import ModelLoadError, load_causal_lm
from inference.engine.lm.variant_writer import build_variant_dir
from inference.engine.lm.variants import VARIANT_KINDS, VariantError, measure_variant, model_size_bytes
from inference.heldout_prompts import load_heldout_prompts
from metadata.models import ModelRole, ModelVersion

logger = logging.getLogger(__name__)
#: Held-out prompts the build measures agreement on (at most this many, this many tokens each).
MEASURE_PROMPTS, MEASURE_TOKENS = 4, 128


class VariantBuildError(Exception):
    """A variant cannot be built from this version (it is a variant, bad kind, wrong device)."""


def variant_version(base: ModelVersion, kind: str) -> str:
    return f"{base.version}+{kind}"


def _stored_path(directory: Path) -> str:
    try:
        return str(directory.resolve().relative_to(conf.MODEL_DIR.resolve()))
    except ValueError:
        return str(directory.resolve())


def _measure_prompts(tokenizer) -> list[list[int]]:
    """Token ids of the demo's held-out prompts when they are there, else a few library lines."""
    path = conf.MODEL_DIR / "heldout_prompts.json"
    try:
        texts = load_heldout_prompts(path)[:MEASURE_PROMPTS]
    except (OSError, ValueError, KeyError):
        texts = [Path(__file__).read_text()[i * 600:(i + 1) * 600] for i in range(MEASURE_PROMPTS)]
    return [tokenizer(text, add_special_tokens=False)["input_ids"][:MEASURE_TOKENS] for text in texts]


def _figures(base: ModelVersion, variant_dir: Path, kind: str, measure: bool) -> dict:
    base_model = load_causal_lm(base.directory)
    variant = load_causal_lm(variant_dir)
    if not measure or kind == "compiled":  # compiling takes minutes here: bench/optimise.py measures it
        return {"size_bytes": model_size_bytes(variant.model), "base_size_bytes": model_size_bytes(base_model.model),
                "measured": "size only (bench/optimise.py measures speed and acceptance)"}
    return measure_variant(base_model.model, variant.model, _measure_prompts(base_model.tokenizer))


def build_variant(base: ModelVersion, kind: str, measure: bool = True) -> ModelVersion:
    """Build (or rebuild) the ``kind`` variant of ``base`` and register it, staged; return it."""
    if kind not in VARIANT_KINDS:
        raise VariantBuildError(f"kind must be one of {', '.join(VARIANT_KINDS)}, not {kind!r}")
    if base.base_id is not None:
        raise VariantBuildError(f"{base} is itself a {base.variant} variant; build variants of {base.base}")
    if kind == "int8" and base.device != "cpu":
        raise VariantBuildError(f"{base} runs on {base.device}; int8 dynamic quantisation runs on the CPU only")
    version = variant_version(base, kind)
    if len(version) > ModelVersion._meta.get_field("version").max_length:
        raise VariantBuildError(f"version {version!r} is too long for the registry")
    started = time.monotonic()
    try:
        directory, recipe = build_variant_dir(base.directory, kind, role=base.role)
        figures = _figures(base, directory, kind, measure)
    except (VariantError, ModelLoadError, OSError) as exc:
        raise VariantBuildError(f"cannot build the {kind} variant of {base}: {exc}") from exc
    figures.update(build_seconds=round(time.monotonic() - started, 2), measured_at=timezone.now().isoformat())
    with transaction.atomic():
        variant, _ = ModelVersion.objects.update_or_create(
            base=base, variant=kind,
            defaults={"name": base.name, "version": version, "role": base.role, "path": _stored_path(directory),
                      "device": base.device, "context_length": base.context_length,
                      "default_draft": base.default_draft if base.role == ModelRole.TARGET else None,
                      "recipe": recipe.to_json(), "figures": figures},
        )
    logger.info("built %s in %.1f s: %s", variant, figures["build_seconds"], figures)
    return variant
