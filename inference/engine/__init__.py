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
"""

from inference.engine.config import DraftConfig, GenerationConfig
from inference.engine.decode.decoder import SpeculativeDecoder, check_prompt, resolve_eos
from inference.engine.decode.draft_tree import DraftTree
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
from inference.engine.decode.target_only import generate_plain

__all__ = [
    "AUTO",
    "DRAFTERS",
    "DRAFTER_KINDS",
    "DRAFTER_PARAMETERS",
    "Branch",
    "ConfigError",
    "DraftConfig",
    "DraftTree",
    "Drafter",
    "DrafterKind",
    "DrafterParameter",
    "EngineError",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "LoadedModel",
    "ModelLoadError",
    "PromptTooLongError",
    "SpeculativeDecoder",
    "StepOutput",
    "UnsupportedModelError",
    "build_drafter",
    "check_pair_compatible",
    "check_pair_directories",
    "check_prompt",
    "describe_model",
    "draftable_ids",
    "drafter_kind",
    "generate_plain",
    "load_causal_lm",
    "load_model_pair",
    "resolve_eos",
]
