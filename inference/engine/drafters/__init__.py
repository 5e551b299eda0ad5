"""Drafters, one module each, behind the `Drafter` interface; ``kinds`` names and builds them.

* ``base``: the `Drafter` interface (`propose` a `DraftTree` for a `DraftRequest`), `NoDrafter`;
* ``draft_model``: chains from a small draft model; ``tree``: trees from it, shaped by
  ``tree_plan`` and ``calibration``; ``ngram``: prompt lookup (what followed the last n tokens
  earlier in the context); ``suffix``: what followed the context's suffix in earlier outputs;
* ``kinds``: `DRAFTERS`, the one list of drafter kinds (name, constructor, draft-model need,
  settings), and `build_drafter`.
"""

from __future__ import annotations

# decode first: its decoder imports ``base``, which needs decode's leaves; loaded from here first,
# ``base`` would be half-built when the decoder asks for it.
import inference.engine.decode  # noqa: F401
from inference.engine.drafters.base import Drafter, DraftRequest, NoDrafter
from inference.engine.drafters.draft_model import (
    DraftModelDrafter,
    DraftModelRunner,
    ModelBackedDrafter,
)
from inference.engine.drafters.ngram import NgramDrafter
from inference.engine.drafters.kinds import (
    AUTO,
    DRAFTER_KINDS,
    DRAFTER_PARAMETERS,
    DRAFTERS,
    PARAMETER_NAMES,
    DrafterKind,
    DrafterParameter,
    build_drafter,
    drafter_kind,
)
from inference.engine.drafters.suffix import SuffixCorpora, SuffixDrafter, SuffixIndex, suffix_corpora
from inference.engine.drafters.tree import TreeDrafter

__all__ = ["AUTO", "DRAFTERS", "DRAFTER_KINDS", "DRAFTER_PARAMETERS", "PARAMETER_NAMES",
           "DraftModelDrafter", "DraftModelRunner", "DraftRequest", "Drafter", "DrafterKind",
           "DrafterParameter", "ModelBackedDrafter", "NgramDrafter", "NoDrafter", "SuffixCorpora",
           "SuffixDrafter", "SuffixIndex", "TreeDrafter", "build_drafter", "drafter_kind", "suffix_corpora"]
