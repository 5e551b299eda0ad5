"""Drafters, one module each, behind the `Drafter` interface; `build_drafter` picks one by name."""

from __future__ import annotations

from transformers import PreTrainedModel

from inference.engine.config import DraftConfig
from inference.engine.drafters.base import Drafter, DraftRequest, NoDrafter
from inference.engine.drafters.draft_model import DraftModelDrafter
from inference.engine.drafters.ngram import NgramDrafter
from inference.engine.drafters.tree import TreeDrafter
from inference.engine.errors import ConfigError
from inference.engine.modeling import logits_width

DRAFTER_KINDS = ("draft_model", "ngram", "tree", "none")

__all__ = ["DRAFTER_KINDS", "DraftModelDrafter", "DraftRequest", "Drafter", "NgramDrafter",
           "NoDrafter", "TreeDrafter", "build_drafter"]


def build_drafter(
    kind: str,
    target: PreTrainedModel,
    draft: PreTrainedModel | None = None,
    config: DraftConfig | None = None,
) -> Drafter:
    """Build the drafter named `kind` for `target` (and `draft`, for the model-based kinds)."""
    config = config or DraftConfig()
    if kind not in DRAFTER_KINDS:
        raise ConfigError(f"drafter: must be one of {', '.join(DRAFTER_KINDS)}, got {kind!r}")
    if kind == "none":
        return NoDrafter(config)
    if kind == "ngram":
        return NgramDrafter(config)
    if draft is None:
        raise ConfigError(f"draft: the {kind!r} drafter needs a draft model")
    if draft.device != target.device:
        raise ConfigError(f"draft: on {draft.device}, the target is on {target.device}")
    width = logits_width(target)
    if kind == "draft_model":
        return DraftModelDrafter(draft, width, config)
    return TreeDrafter(draft, width, config)
