"""The KV manager's contract, with no engine: each cache's rows and its row list stay in step.

`KVManager` (batch/kv_manager.py) owns a target and a draft cache and the rows each holds; the
engine's equivalence across the move is shown by the batch tests. Here: rows added to the
target only or to both, indices by identity, release of some rows (and of rows held elsewhere),
adoption of a row's keys and values from another manager (the prefill lane's), and the errors
for a cache row that was never appended.
"""

from __future__ import annotations

import pytest
import torch

from inference.engine.batch.kv_manager import KVManager
from inference.engine.batch.rows import BatchRequest, BatchRow
from inference.engine.config import GenerationConfig
from inference.engine.decode.stopping import StopCondition
from inference.engine.errors import EngineError
from inference.engine.kv.ragged import RaggedCache, RowInput

from .conftest import noisy_copy, target_model


def _row(name: str, prompt: list[int], drafter: str = "none") -> BatchRow:
    config = GenerationConfig(max_new_tokens=4)
    return BatchRow(BatchRequest(name, prompt, config, drafter), drafter, 4,
                    StopCondition(config, 4, lambda ids: ""), torch.device("cpu"))


def _manager() -> KVManager:
    return KVManager(RaggedCache(target_model("llama")), RaggedCache(noisy_copy("llama")))


def _empty(target: RaggedCache, draft: RaggedCache | None) -> None:
    target.add_row()
    if draft is not None:
        draft.add_row()


def test_rows_map_to_their_cache_rows_and_only_drafting_rows_hold_a_draft_row():
    kv = _manager()
    handed = []
    rows = [_row("a", [3, 4]), _row("b", [5, 6], "draft_model"), _row("c", [7]), _row("d", [8], "draft_model")]
    for row in rows:
        drafts = row.drafter_kind == "draft_model"
        kv.add(row, drafts, lambda target, draft: (handed.append(draft is not None), _empty(target, draft)))
    assert handed == [False, True, False, True]
    assert kv.rows == rows and kv.draft_rows == [rows[1], rows[3]]
    assert (kv.target.rows, kv.draft.rows) == (4, 2)
    assert [kv.index(row) for row in rows] == [0, 1, 2, 3]
    assert [kv.draft_index(row) for row in rows] == [None, 0, None, 1]
    assert kv.index(_row("a", [3, 4])) is None  # the same request, another row: by identity


def test_release_frees_the_rows_held_and_keeps_the_others_in_order():
    kv = _manager()
    rows = [_row(name, [3], "draft_model" if name in "bd" else "none") for name in "abcde"]
    for row in rows:
        kv.add(row, row.drafter_kind == "draft_model", _empty)
    kv.target.forward([RowInput([10 + index], [0]) for index in range(5)], logits="none")
    keys = kv.target.row_prefix(3, 1)  # row d's
    kv.release([rows[1], rows[2], _row("elsewhere", [3])])  # a row held elsewhere is no matter
    assert kv.rows == [rows[0], rows[3], rows[4]] and kv.draft_rows == [rows[3]]
    assert (kv.target.rows, kv.draft.rows) == (3, 1)
    assert kv.index(rows[3]) == 1 and kv.draft_index(rows[3]) == 0
    for moved, before in zip(kv.target.row_prefix(1, 1), keys):
        assert torch.equal(moved[0], before[0]) and torch.equal(moved[1], before[1])
    kv.release(rows)
    assert kv.rows == [] and kv.draft_rows == [] and kv.target.rows == kv.draft.rows == 0


def test_adopt_copies_the_rows_keys_and_values_from_another_manager():
    lane, batch = _manager(), _manager()
    prefilled, plain = _row("p", [3, 4, 5], "draft_model"), _row("q", [6, 7])
    for row in (prefilled, plain):
        lane.add(row, row.drafter_kind == "draft_model", _empty)
    batch.add(_row("decoding", [9]), False, _empty)
    lane.target.forward([RowInput([3, 4, 5], [0, 1, 2]), RowInput([6, 7], [0, 1])], logits="none")
    lane.draft.forward([RowInput([3, 4], [0, 1])], logits="none")
    batch.adopt(prefilled, lane)
    batch.adopt(plain, lane)
    assert batch.index(prefilled) == 1 and batch.draft_index(prefilled) == 0
    assert batch.index(plain) == 2 and batch.draft_index(plain) is None
    assert batch.target.lengths() == [0, 3, 2] and batch.draft.lengths() == [2]
    for cache, theirs, index, length in ((batch.target, lane.target, 0, 3), (batch.draft, lane.draft, 0, 2)):
        mine = cache.row_prefix(1 if cache is batch.target else 0, length)
        for got, want in zip(mine, theirs.row_prefix(index, length)):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert lane.rows == [prefilled, plain]  # the lane lets them go when it releases them
    lane.release([prefilled, plain])
    assert lane.target.rows == lane.draft.rows == 0


def test_a_cache_row_never_appended_or_a_draft_row_without_a_draft_cache_is_an_error():
    kv = _manager()
    with pytest.raises(EngineError):
        kv.add(_row("a", [3]), False, lambda target, draft: None)
    with pytest.raises(EngineError):
        kv.add(_row("b", [3], "draft_model"), True, lambda target, draft: target.add_row())
    with pytest.raises(EngineError):
        KVManager(RaggedCache(target_model("llama"))).add(_row("c", [3], "draft_model"), True, _empty)
    with pytest.raises(EngineError):
        kv.adopt(_row("d", [3]), _manager())
