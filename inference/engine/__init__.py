"""SpecOps inference engine: speculative decoding on PyTorch + transformers, no Django.

    target, draft = load_model_pair("models/demo-target", "models/demo-draft")
    decoder = SpeculativeDecoder(target, build_drafter("draft_model", target, draft,
                                                       DraftConfig(length=4)))
    for step in decoder.stream(prompt_ids, GenerationConfig(max_new_tokens=64)):
        ...

A LoadedModel goes straight in (its tokenizer decodes stop strings); `eos_token_id=None` stops
at the target's own EOS. `DRAFTERS` is the list of drafter kinds and the settings each takes.

Subpackages, each with its public API in its ``__init__``: ``lm`` (the language models: loading, lean modeling,
kernels, variants), ``kv`` (caches), ``decode`` (one sequence: decoder, verifier, sampling,
stopping, draft trees), ``drafters`` (one module per drafter, and ``kinds``, their list), ``batch``
(many sequences in one forward). Beside them: ``config`` (GenerationConfig, DraftConfig),
``outputs``, ``stats`` and ``errors``. No Django here: the engine runs and is tested without it.

Importing this package loads nothing: each name below is imported from its module on first use
(``_HOMES``), so a Django process that reads one constant or config class (``inference.engine.config``,
``inference.engine.lm.variants.recipes``) does not pay for torch. The imports under ``TYPE_CHECKING``
are the same names, for type checkers and for tests/test_import_graph.py, which reads them as edges;
tests/test_startup_imports.py checks that the two lists agree.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inference.engine.config import DraftConfig, GenerationConfig
    from inference.engine.decode.decoder import SpeculativeDecoder, check_prompt, resolve_eos
    from inference.engine.decode.draft_tree import DraftTree
    from inference.engine.decode.target_only import generate_plain
    from inference.engine.drafters import (
        AUTO,
        DRAFTER_KINDS,
        DRAFTER_PARAMETERS,
        DRAFTERS,
        Drafter,
        DrafterKind,
        DrafterParameter,
        build_drafter,
        drafter_kind,
    )
    from inference.engine.errors import (
        ConfigError,
        EngineError,
        PromptTooLongError,
        UnsupportedModelError,
    )
    from inference.engine.lm.loading import (
        LoadedModel,
        ModelLoadError,
        check_pair_compatible,
        check_pair_directories,
        describe_model,
        load_causal_lm,
        load_model_pair,
    )
    from inference.engine.lm.modeling import draftable_ids
    from inference.engine.outputs import Branch, GenerationResult, StepOutput
    from inference.engine.stats import GenerationStats

_MODULES = {  # module -> the names this package re-exports from it
    "inference.engine.config": ("DraftConfig", "GenerationConfig"),
    "inference.engine.decode.decoder": ("SpeculativeDecoder", "check_prompt", "resolve_eos"),
    "inference.engine.decode.draft_tree": ("DraftTree",),
    "inference.engine.decode.target_only": ("generate_plain",),
    "inference.engine.drafters": ("AUTO", "DRAFTER_KINDS", "DRAFTER_PARAMETERS", "DRAFTERS", "Drafter",
                                  "DrafterKind", "DrafterParameter", "build_drafter", "drafter_kind"),
    "inference.engine.errors": ("ConfigError", "EngineError", "PromptTooLongError", "UnsupportedModelError"),
    "inference.engine.lm.loading": ("LoadedModel", "ModelLoadError", "check_pair_compatible",
                                    "check_pair_directories", "describe_model", "load_causal_lm",
                                    "load_model_pair"),
    "inference.engine.lm.modeling": ("draftable_ids",),
    "inference.engine.outputs": ("Branch", "GenerationResult", "StepOutput"),
    "inference.engine.stats": ("GenerationStats",),
}
_HOMES = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """``name`` from its module, imported now; kept in the package so the next lookup is plain."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
