"""SpecOps inference engine: speculative decoding on PyTorch + transformers, no Django.

    decoder = SpeculativeDecoder(target, build_drafter("draft_model", target=target, draft=draft,
                                                       config=DraftConfig(length=4)), decode=tok.decode)
    for step in decoder.stream(prompt_ids, GenerationConfig(max_new_tokens=64)):
        ...
"""

from inference.engine.config import DraftConfig, GenerationConfig
from inference.engine.decoder import SpeculativeDecoder
from inference.engine.draft_tree import DraftTree
from inference.engine.drafters import DRAFTER_KINDS, Drafter, build_drafter
from inference.engine.errors import (
    ConfigError,
    EngineError,
    PromptTooLongError,
    UnsupportedModelError,
)
from inference.engine.outputs import Branch, GenerationResult, StepOutput
from inference.engine.stats import GenerationStats
from inference.engine.target_only import generate_plain

__all__ = [
    "DRAFTER_KINDS",
    "Branch",
    "ConfigError",
    "DraftConfig",
    "DraftTree",
    "Drafter",
    "EngineError",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "PromptTooLongError",
    "SpeculativeDecoder",
    "StepOutput",
    "UnsupportedModelError",
    "build_drafter",
    "generate_plain",
]
