"""The drafter registry: one list of names, constructors and the settings each kind takes."""

from __future__ import annotations

import dataclasses

import pytest

from inference.engine import (
    AUTO,
    DRAFTER_KINDS,
    DRAFTERS,
    ConfigError,
    DraftConfig,
    build_drafter,
)
from inference.engine.drafters import DRAFTER_PARAMETERS, PARAMETER_NAMES, drafter_kind

from inference.engine.drafters.dspark import load_dspark

from .conftest import draft_model, target_model
from .dspark_models import write_deepspec_checkpoint

DRAFT_CONFIG_FIELDS = {field.name for field in dataclasses.fields(DraftConfig)}


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_every_kind_builds_a_drafter_that_carries_its_registry_name(kind, tmp_path):
    target = target_model("llama")
    dspark = None
    if DRAFTERS[kind].needs_dspark:
        dspark = load_dspark(write_deepspec_checkpoint(tmp_path / "dspark", target, target_layer_ids=(-1, 0)),
                             target)
    drafter = build_drafter(kind, target=target, draft=draft_model("llama"), dspark=dspark)
    assert drafter.name == kind == DRAFTERS[kind].name
    assert (drafter.draft_model is not None) == DRAFTERS[kind].needs_draft_model


def test_auto_is_a_name_but_must_be_resolved_before_building():
    assert AUTO in DRAFTERS and AUTO not in DRAFTER_KINDS
    assert DRAFTERS[AUTO].uses_draft_model and not DRAFTERS[AUTO].needs_draft_model
    with pytest.raises(ConfigError, match="'auto' must be resolved"):
        build_drafter(AUTO, target=target_model("gpt2"), draft=draft_model("gpt2"))
    with pytest.raises(ConfigError, match="drafter: must be one of draft_model, ngram, suffix, tree, dspark, none, auto"):
        drafter_kind("medusa")


def test_each_kind_names_real_config_fields_and_its_parameters_among_them():
    for kind in DRAFTERS.values():
        assert set(kind.config_fields) <= DRAFT_CONFIG_FIELDS, kind.name
        assert {parameter.field for parameter in kind.parameters} <= set(kind.config_fields), kind.name
        assert kind.uses_draft_model >= kind.needs_draft_model
    assert DRAFTERS["none"].config_fields == DRAFTERS["none"].parameters == ()
    assert set(PARAMETER_NAMES) == {"draft_length", "tree_width", "tree_depth", "node_budget", "ngram_size"}
    for parameter in DRAFTER_PARAMETERS:
        assert parameter.minimum <= parameter.default <= parameter.maximum


def test_request_parameters_map_to_a_draft_config_and_foreign_ones_are_refused():
    tree = DRAFTERS["tree"]
    params = {"max_new_tokens": 9, "tree_width": 3, "node_budget": 5}
    assert tree.request_params(params) == {"tree_width": 3, "tree_depth": 4, "node_budget": 5}
    config = tree.draft_config(params)
    assert (config.tree_width, config.tree_depth, config.node_budget) == (3, 4, 5)
    assert DRAFTERS["draft_model"].draft_config({"draft_length": 6}).length == 6
    with pytest.raises(ConfigError, match=r"^draft_length: the 'tree' drafter does not take draft_length"):
        tree.draft_config({"draft_length": 4})
    assert tree.draft_config({"draft_length": 4}, strict=False) == DraftConfig()
