"""A promotion frees the old pair: the batching loop drops idle engines of targets no longer active
and evicts their models, while an engine with work, or of an active target, stays."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from inference.registry import register_version
from inference.worker.batching_loop import DeviceBatchLoop
from inference.worker.residency import residency


def engine(busy: bool = False):
    return SimpleNamespace(has_work=lambda: busy)


@pytest.mark.django_db
def test_idle_engines_of_retired_targets_leave_and_their_models_are_evicted(tiny_model):
    newer = register_version("tiny", "2", "target", tiny_model.directory, default_draft=tiny_model.default_draft)
    newer.promote()  # tiny:1 is retired now
    draft_id = tiny_model.default_draft_id
    loop = DeviceBatchLoop(max_rows=4, prefill_chunk=0, policy_enabled=False)
    loop.engines = {(tiny_model.pk, draft_id): engine(), (newer.pk, draft_id): engine(),
                    (tiny_model.pk, None): engine(busy=True)}
    residency._loaded.update({tiny_model.pk: "old weights", draft_id: "draft weights", newer.pk: "new weights"})
    try:
        dropped = loop.drop_retired_engines()
        assert dropped == [(tiny_model.pk, draft_id)]
        assert set(loop.engines) == {(newer.pk, draft_id), (tiny_model.pk, None)}  # busy: until its rows end
        assert tiny_model.pk in residency._loaded  # the busy engine still reads the old target
        assert draft_id in residency._loaded and newer.pk in residency._loaded  # still in use
        loop.engines[(tiny_model.pk, None)] = engine(busy=False)  # its rows ended
        assert loop.drop_retired_engines() == [(tiny_model.pk, None)]
        assert tiny_model.pk not in residency._loaded
    finally:
        for key in (tiny_model.pk, draft_id, newer.pk):
            residency._loaded.pop(key, None)
