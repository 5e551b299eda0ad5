"""The engine core's model residency keeps its models out of CPython's full collections (a
gen-2 pause walked them all every few seconds under load), and gives an evicted model's cycles
back to the collector; a residency elsewhere (a front's, a test's) leaves the collector alone."""
import gc
import weakref

import pytest

from inference.engine_core.model_residency import ModelResidency
from inference.engine_core.protocol import ModelSpec


@pytest.fixture
def thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()


@pytest.fixture
def target_spec(tiny_model_dirs):
    return ModelSpec(1, str(tiny_model_dirs[0]), label="tiny target")


def frozen(obj) -> bool:
    """Tracked by the collector but in none of its generations: in the permanent one."""
    return gc.is_tracked(obj) and not any(candidate is obj for candidate in gc.get_objects())


def test_the_engine_cores_residency_freezes_what_it_loads(target_spec, thawed):
    loaded = ModelResidency(capacity=2, freeze_loaded=True).get(target_spec)
    assert frozen(loaded.model) and frozen(next(loaded.model.modules()).__dict__)
    assert gc.get_freeze_count() > 0


def test_a_residency_that_does_not_live_with_its_models_freezes_nothing(target_spec, thawed):
    loaded = ModelResidency(capacity=2).get(target_spec)
    assert gc.get_freeze_count() == 0 and not frozen(loaded.model)


def test_a_model_pushed_out_by_the_capacity_is_collected_too(tiny_model_dirs, target_spec, thawed):
    residency = ModelResidency(capacity=1, freeze_loaded=True)
    model = residency.get(target_spec).model
    model.__dict__["_cycle"] = model
    gone = weakref.ref(model)
    del model
    residency.get(ModelSpec(2, str(tiny_model_dirs[1]), label="tiny draft"))  # the LRU's one place
    assert gone() is None, "a frozen cycle is never collected: the LRU's eviction must thaw it"


def test_an_evicted_model_in_a_cycle_is_collected(target_spec, thawed):
    residency = ModelResidency(capacity=2, freeze_loaded=True)
    model = residency.get(target_spec).model
    model.__dict__["_cycle"] = model  # unreachable once dropped, freed only by a collection
    gone = weakref.ref(model)
    del model
    assert residency.evict(target_spec.pk)
    assert gone() is None, "a frozen cycle is never collected: eviction must thaw it"
