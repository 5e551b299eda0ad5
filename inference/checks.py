"""System checks for inference settings that parse but are wrong (ids are stable: specops.E003, E004, E005, E006, W002)."""
from __future__ import annotations

import os

from django.core.checks import Error, Warning, register

from inference.conf import conf as inference_conf

# inference.engine.batch.prefill's modes, and auto; written out so a web process's checks never
# import the engine (and torch)
PREFILL_MODES = ("auto", "shared", "separate")


@register()
def check_prefill_mode(app_configs=None, **kwargs) -> list:
    """SPECOPS_PREFILL names a prefill mode; a typo would otherwise fail every session of a worker."""
    mode = inference_conf.PREFILL
    if mode not in PREFILL_MODES:
        return [Error(f"SPECOPS_PREFILL {mode!r} is not a prefill mode.",
                      hint=f"Use one of: {', '.join(PREFILL_MODES)}.", id="specops.E003")]
    return []


ENGINE_CORE_MODES = ("process", "thread")


@register()
def check_engine_core(app_configs=None, **kwargs) -> list:
    """SPECOPS_ENGINE_CORE names where the engines run; a typo would otherwise fail the worker's first session."""
    mode = inference_conf.ENGINE_CORE
    if mode not in ENGINE_CORE_MODES:
        return [Error(f"SPECOPS_ENGINE_CORE {mode!r} is not an engine-core mode.",
                      hint=f"Use one of: {', '.join(ENGINE_CORE_MODES)}.", id="specops.E004")]
    return []


# inference.engine.runner's compile modes, written out for the same reason
ENGINE_COMPILE_MODES = ("auto", "off")


@register()
def check_engine_compile(app_configs=None, **kwargs) -> list:
    """SPECOPS_ENGINE_COMPILE names a compile mode and the KV budget is positive: a typo would
    otherwise fail the worker's first engine."""
    errors = []
    mode = inference_conf.ENGINE_COMPILE
    if mode not in ENGINE_COMPILE_MODES:
        errors.append(Error(f"SPECOPS_ENGINE_COMPILE {mode!r} is not a compile mode.",
                            hint=f"Use one of: {', '.join(ENGINE_COMPILE_MODES)}.", id="specops.E006"))
    if inference_conf.KV_CACHE_MB < 1:
        errors.append(Error(f"SPECOPS_KV_CACHE_MB {inference_conf.KV_CACHE_MB} must be 1 or more.",
                            hint="It bounds each model's preallocated KV pools (the compiled path).", id="specops.E006"))
    return errors


# The variable that once made the prefix cache shared by every tenant: a deployment that still
# sets it expects a sharing that no longer happens (tenants share only through a group).
RETIRED_ISOLATION_VARIABLE = "SPECOPS_PREFIX_CACHE_ISOLATION"


@register()
def check_prefix_cache(app_configs=None, **kwargs) -> list:
    """The prefix cache's size and block are not negative, and nothing asks for sharing across
    tenants: the tenant is the cache's trust boundary (tenants share only through an operator's
    ``prefix_cache_group``), so a leftover ``shared`` must not pass unnoticed."""
    errors = []
    isolation = os.environ.get(RETIRED_ISOLATION_VARIABLE)
    if isolation is not None and isolation.strip() != "tenant":
        errors.append(Error(f"{RETIRED_ISOLATION_VARIABLE}={isolation!r}: the prefix cache is isolated per tenant; "
                            "no setting shares it across tenants.",
                            hint="Unset it, and give tenants that trust each other one prefix_cache_group "
                                 "(admin, Tenants).", id="specops.E005"))
    if inference_conf.PREFIX_CACHE_MB < 0 or inference_conf.PREFIX_CACHE_BLOCK < 1:
        errors.append(Error("SPECOPS_PREFIX_CACHE_MB must be 0 or more and SPECOPS_PREFIX_CACHE_BLOCK 1 or more.",
                            hint="SPECOPS_PREFIX_CACHE_MB=0 turns the prefix cache off.", id="specops.E005"))
    return errors


@register()
def check_model_dir(app_configs=None, **kwargs) -> list:
    """Warn when SPECOPS_MODEL_DIR points at a file: workers could never load a model from it."""
    model_dir = inference_conf.MODEL_DIR
    if model_dir.exists() and not model_dir.is_dir():
        return [
            Warning(
                f"SPECOPS_MODEL_DIR {model_dir} is not a directory.",
                hint="Point SPECOPS_MODEL_DIR at a directory of save_pretrained model folders.",
                id="specops.W002",
            )
        ]
    return []
