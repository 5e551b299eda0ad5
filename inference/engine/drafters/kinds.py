"""The one list of drafter kinds: name, constructor, draft-model need, settings each one takes.

Everything that names a drafter reads this table: `build_drafter`, `Drafter.name`, the API
serializer (choices, per-kind request parameters), the worker (a session's DraftConfig:
`DRAFTERS[session.drafter].draft_config(session.params)`).
`auto` is a pseudo-kind: "let the serving policy choose"; the policy resolves it to a concrete
kind before anything is built, so it has no constructor.

A request parameter (`DrafterParameter`) is the public name of one DraftConfig field, with the
bounds a request may ask for; a kind takes some of them, and a request that gives a parameter
its drafter does not take is refused instead of being ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel

from inference.engine.config import DraftConfig
from inference.engine.drafters.base import Drafter, NoDrafter
from inference.engine.drafters.draft_model import DraftModelDrafter
from inference.engine.drafters.dspark.drafter import DSparkDrafter
from inference.engine.drafters.dspark.modeling import DSparkModel
from inference.engine.drafters.ngram import NgramDrafter
from inference.engine.drafters.suffix import SuffixDrafter
from inference.engine.drafters.tree import TreeDrafter
from inference.engine.errors import ConfigError
from inference.engine.lm.loading import LoadedModel, check_pair_compatible, unwrap_model
from inference.engine.lm.modeling import logits_width

AUTO = "auto"

_DRAFT_CONFIG_FIELDS = {field.name: field for field in dataclasses.fields(DraftConfig)}
# read by the decoder's DraftLengthSchedule for every kind that drafts
_SCHEDULE_FIELDS = ("adaptive", "min_length", "max_length")


@dataclass(frozen=True)
class DrafterParameter:
    """A drafter setting a request may give: its public name, its DraftConfig field, its bounds."""

    name: str
    field: str
    minimum: int
    maximum: int
    help: str

    def __post_init__(self) -> None:
        if self.field not in _DRAFT_CONFIG_FIELDS:
            raise ConfigError(f"{self.name}: names no DraftConfig field ({self.field!r})")

    @property
    def default(self) -> Any:
        return _DRAFT_CONFIG_FIELDS[self.field].default


DRAFT_LENGTH = DrafterParameter("draft_length", "length", 1, 8, "tokens drafted per step")
TREE_WIDTH = DrafterParameter("tree_width", "tree_width", 1, 8, "children expanded per tree node")
TREE_DEPTH = DrafterParameter("tree_depth", "tree_depth", 1, 16, "levels of the draft tree")
NODE_BUDGET = DrafterParameter("node_budget", "node_budget", 1, 64, "tree nodes verified per step")
NGRAM_SIZE = DrafterParameter("ngram_size", "ngram_size", 1, 8, "longest n-gram matched")


@dataclass(frozen=True)
class DrafterKind:
    """One drafter kind of the list.

    drafter_class: the constructor, called as `cls(draft, target_logits_width, config)` when
    the kind needs a draft model (a ModelBackedDrafter) and `cls(config)` otherwise (None for
    `auto`, which is resolved, never built); uses_draft_model: a draft model goes with it when the target has
    one (the kinds that need one, and `auto`, which may pick them); config_fields: every
    DraftConfig field it reads; parameters: those of them a request may set; uses_corpus: it
    drafts from a corpus of earlier outputs and is built as `cls(config, corpus=key)`;
    needs_dspark: it runs a DSpark checkpoint trained for the target (drafters/dspark), built as
    `cls(dspark_model, target_logits_width, config)`.
    """

    name: str
    summary: str
    drafter_class: type[Drafter] | None
    needs_draft_model: bool = False
    uses_draft_model: bool = False
    config_fields: tuple[str, ...] = ()
    parameters: tuple[DrafterParameter, ...] = ()
    uses_corpus: bool = False
    needs_dspark: bool = False

    def __post_init__(self) -> None:
        unknown = [name for name in self.config_fields if name not in _DRAFT_CONFIG_FIELDS]
        if unknown:
            raise ConfigError(f"config_fields: {self.name!r} names no DraftConfig field {unknown}")

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return tuple(parameter.name for parameter in self.parameters)

    def takes(self, parameter_name: str) -> bool:
        return parameter_name in self.parameter_names

    def refusal(self, parameter_name: str) -> str:
        """Why a request may not give `parameter_name` to this kind (one sentence)."""
        takes = ", ".join(self.parameter_names) or "no parameters"
        return f"the '{self.name}' drafter does not take {parameter_name} (it takes {takes})"

    def request_params(self, params: Mapping[str, Any], strict: bool = True) -> dict[str, Any]:
        """Every parameter this kind takes, as given in `params` or its default.

        Keys of `params` that are no drafter parameter (max_new_tokens, ...) are ignored; a
        parameter of another kind raises ConfigError naming it, unless `strict` is off.
        """
        if strict:
            for name in PARAMETER_NAMES:
                if name in params and not self.takes(name):
                    raise ConfigError(f"{name}: {self.refusal(name)}")
        return {p.name: params.get(p.name, p.default) for p in self.parameters}

    def draft_config(self, params: Mapping[str, Any], strict: bool = True) -> DraftConfig:
        """The DraftConfig of a request's parameters (e.g. a session's params)."""
        by_name = {parameter.name: parameter for parameter in self.parameters}
        values = self.request_params(params, strict)
        return DraftConfig(**{by_name[name].field: value for name, value in values.items()})

    def build(self, target: PreTrainedModel, draft: PreTrainedModel | None,
              config: DraftConfig, corpus: Hashable | None = None) -> Drafter:
        """Construct the drafter (`build_drafter` checks the models first)."""
        if self.drafter_class is None:
            raise ConfigError(f"drafter: {self.name!r} must be resolved to one of "
                              f"{', '.join(DRAFTER_KINDS)} (by the serving policy) before a "
                              "drafter is built")
        if self.needs_draft_model:
            return self.drafter_class(draft, logits_width(target), config)
        if self.uses_corpus:
            return self.drafter_class(config, corpus=corpus)
        return self.drafter_class(config)


_KINDS = (
    DrafterKind("draft_model", "a small LM drafts a chain", DraftModelDrafter,
                needs_draft_model=True, uses_draft_model=True,
                config_fields=("length", "confidence_threshold", *_SCHEDULE_FIELDS),
                parameters=(DRAFT_LENGTH,)),
    DrafterKind("ngram", "prompt lookup: what followed the last n tokens earlier", NgramDrafter,
                config_fields=("length", "ngram_size", "ngram_min_size", *_SCHEDULE_FIELDS),
                parameters=(DRAFT_LENGTH, NGRAM_SIZE)),
    DrafterKind("suffix", "the most frequent continuations in earlier outputs (own and the tenant's)",
                SuffixDrafter, uses_corpus=True,
                config_fields=("length", "node_budget", "confidence_threshold", *_SCHEDULE_FIELDS),
                parameters=(DRAFT_LENGTH, NODE_BUDGET)),
    DrafterKind("tree", "a small LM drafts a tree, verified in one forward", TreeDrafter,
                needs_draft_model=True, uses_draft_model=True,
                config_fields=("tree_width", "tree_depth", "node_budget", *_SCHEDULE_FIELDS),
                parameters=(TREE_WIDTH, TREE_DEPTH, NODE_BUDGET)),
    DrafterKind("dspark", "a DSpark block on the target's own features, one forward per step",
                DSparkDrafter, needs_dspark=True,
                config_fields=("confidence_threshold", *_SCHEDULE_FIELDS)),
    DrafterKind("none", "target only, one token per step", NoDrafter),
    DrafterKind(AUTO, "the serving policy chooses the drafter and its depth", None,
                uses_draft_model=True, config_fields=("length",), parameters=(DRAFT_LENGTH,)),
)

#: every name a request may give, `auto` included, in a stable order
DRAFTERS: Mapping[str, DrafterKind] = {kind.name: kind for kind in _KINDS}
#: the kinds that can be built (everything but `auto`)
DRAFTER_KINDS: tuple[str, ...] = tuple(kind.name for kind in _KINDS if kind.drafter_class)
#: every request parameter of any kind, each once
DRAFTER_PARAMETERS: tuple[DrafterParameter, ...] = tuple(
    {parameter.name: parameter for kind in _KINDS for parameter in kind.parameters}.values())
PARAMETER_NAMES: tuple[str, ...] = tuple(parameter.name for parameter in DRAFTER_PARAMETERS)

for _kind in _KINDS:  # Drafter.name comes from here
    if _kind.drafter_class is not None:
        _kind.drafter_class.name = _kind.name


def drafter_kind(name: str) -> DrafterKind:
    """The kind `name`; ConfigError naming the choices when there is none."""
    try:
        return DRAFTERS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"drafter: must be one of {', '.join(DRAFTERS)}, got {name!r}") from None


def build_drafter(
    kind: str,
    target: LoadedModel | PreTrainedModel,
    draft: LoadedModel | PreTrainedModel | None = None,
    config: DraftConfig | None = None,
    corpus: Hashable | None = None,
    dspark: DSparkModel | None = None,
) -> Drafter:
    """Build the drafter named `kind` for `target` (and `draft`, for the model-based kinds).

    Takes what `load_causal_lm` returns or bare models. Given two LoadedModels, a kind that
    uses the draft first checks that both share a tokenizer and EOS (ModelLoadError naming
    both directories); bare models carry no tokenizer to check. `corpus`: the key of the
    earlier outputs a corpus-fed kind (suffix) drafts from; the other kinds ignore it.
    `dspark`: the DSpark checkpoint (checkpoint.load_dspark) the `dspark` kind runs.
    """
    entry = drafter_kind(kind)
    config = config or DraftConfig()
    if entry.needs_dspark:
        if dspark is None:
            raise ConfigError(f"drafter: {kind!r} needs a DSpark checkpoint registered for this target")
        target_model = unwrap_model(target)
        dspark.dspark.check_target(target_model)
        return entry.drafter_class(dspark, logits_width(target_model), config)
    if not entry.needs_draft_model:
        return entry.build(unwrap_model(target), None, config, corpus)
    if draft is None:
        raise ConfigError(f"draft: the {kind!r} drafter needs a draft model")
    if isinstance(target, LoadedModel) and isinstance(draft, LoadedModel):
        check_pair_compatible(target, draft)
    target_model, draft_model = unwrap_model(target), unwrap_model(draft)
    if draft_model.device != target_model.device:
        raise ConfigError(f"draft: on {draft_model.device}, the target is on {target_model.device}")
    return entry.build(target_model, draft_model, config)
