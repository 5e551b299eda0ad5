"""The served target through the two-tier cache (``inference.served_targets``): no query once cached,
a promotion seen at once, refusals as before."""
from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from inference.served_targets import ModelNotServed
from inference.registry import register_pair
from inference.served_targets import cached_served_target, target_cache
from metadata.replicas import lsn

pytestmark = pytest.mark.django_db(transaction=True)  # invalidation runs after commit


def served(name: str | None):
    with lsn.floor_scope():
        return cached_served_target(name)


@pytest.fixture(autouse=True)
def empty_local_tier():
    target_cache().clear_local()


def test_a_cached_target_costs_no_query_and_brings_its_draft(tiny_model):
    assert served("tiny").pk == tiny_model.pk
    with CaptureQueriesContext(connection) as queries:
        target = served("tiny")
        assert target.default_draft.pk == tiny_model.default_draft_id
        assert served(None).pk == tiny_model.pk  # no name: the latest promoted
        served(None)
    assert len(queries) == 1, [q["sql"] for q in queries]  # the unnamed lookup's first read only
    assert served("tiny") is not target  # a fresh instance per call


def test_a_promotion_is_seen_at_once(tiny_model, tiny_model_dirs):
    assert served("tiny").version == "1" and served(None).version == "1"
    register_pair("tiny", "2", *tiny_model_dirs)  # registers and promotes
    assert served("tiny").version == "2" and served(None).version == "2"


def test_an_unknown_model_is_refused_as_before(tiny_model):
    with pytest.raises(ModelNotServed, match="no active target model named 'nope'"):
        served("nope")
