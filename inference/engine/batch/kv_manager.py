"""The KV caches of a set of rows: the target's and the draft's, and which row each cache row is.

`KVManager` is a component `BatchedSpeculativeEngine` (engine.py) holds twice, with no
reference back to it: `engine.kv` for the batch's decoding rows and `engine.lane_kv` for the
prefill lane's (prefill.py). It owns a target cache, a draft cache (None without a draft
model) and the rows in each, in cache-row order: row i of `target` is `rows[i]`, row j of
`draft` is `draft_rows[j]`. Every row has a target cache row; only `draft_model` rows have a
draft cache row, so the two lists differ. The lists change only with the caches (`add`,
`adopt`, `release`), so the mapping cannot drift from them.

`rows` is the batch's membership as much as the cache's: the engine reads it as "the rows of
the step", and it stays here because a row is in the batch exactly while it holds a target
cache row (cache row order is the order forwards and verdicts take the rows in).

What a cache row holds at first is the caller's: `add` hands `fill` the caches to append the
row to (empty, or seeded with a cached prefix: prefix_reuse.py), `adopt` copies the row's
cache rows from another manager's (the lane's into the batch's). Forwards run on `target` and
`draft` directly (chain_drafting.py, verification.py, device_step.py); what rows offer to the
prefix cache before they leave is read from the same attributes (engine.py `_release`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from inference.engine.batch.rows import BatchRow
from inference.engine.errors import EngineError
from inference.engine.kv.ragged import RaggedCache
from inference.engine.kv.static_ragged import StaticRaggedCache

Cache = RaggedCache | StaticRaggedCache  # a ragged cache: growing, or on a runner's static pool (runners.py)


def _position(rows: Sequence[BatchRow], row: BatchRow) -> int | None:
    """The index of `row` (by identity) in `rows`, None when it is not there."""
    return next((index for index, held in enumerate(rows) if held is row), None)


class KVManager:
    """A target cache, an optional draft cache and the rows each holds (see the module docstring)."""

    def __init__(self, target: Cache, draft: Cache | None = None) -> None:
        self.target = target
        self.draft = draft
        self.rows: list[BatchRow] = []  # target cache row i is rows[i]
        self.draft_rows: list[BatchRow] = []  # draft cache row j is draft_rows[j]

    def index(self, row: BatchRow) -> int | None:
        """The row's index in the target cache (None: it holds none here)."""
        return _position(self.rows, row)

    def draft_index(self, row: BatchRow) -> int | None:
        """The row's index in the draft cache (None: it holds none here)."""
        return _position(self.draft_rows, row)

    def add(self, row: BatchRow, drafts: bool, fill: Callable[[Cache, Cache | None], object]) -> None:
        """Give `row` the next row of the target cache and, where `drafts`, of the draft cache.

        fill(target, draft or None) appends the row's cache row to each cache it is handed; one
        that does not is a bug, reported as an `EngineError`."""
        if drafts and self.draft is None:
            raise EngineError("a draft_model row needs a draft cache; this engine has no draft model")
        fill(self.target, self.draft if drafts else None)
        self._appended(row, drafts)

    def adopt(self, row: BatchRow, source: KVManager) -> None:
        """Give `row` rows here copied from its rows in `source` (another manager of the same models):
        the target's always, the draft's where it has one there."""
        index, draft_index = source.index(row), source.draft_index(row)
        if index is None:
            raise EngineError("a row can only be adopted from a cache that holds it")
        self.target.adopt_row(source.target, index)
        if draft_index is not None:
            self.draft.adopt_row(source.draft, draft_index)
        self._appended(row, draft_index is not None)

    def _appended(self, row: BatchRow, drafts: bool) -> None:
        if self.target.rows != len(self.rows) + 1 or (drafts and self.draft.rows != len(self.draft_rows) + 1):
            raise EngineError("a cache row was not appended for the row added")
        self.rows.append(row)
        if drafts:
            self.draft_rows.append(row)

    def release(self, rows: Iterable[BatchRow]) -> None:
        """Free the cache rows of those of `rows` held here; the others keep their order."""
        leaving = {id(row) for row in rows}
        keep = [index for index, row in enumerate(self.rows) if id(row) not in leaving]
        if len(keep) != len(self.rows):
            self.target.keep_rows(keep)
            self.rows = [self.rows[index] for index in keep]
        keep = [index for index, row in enumerate(self.draft_rows) if id(row) not in leaving]
        if len(keep) != len(self.draft_rows):
            self.draft.keep_rows(keep)
            self.draft_rows = [self.draft_rows[index] for index in keep]

    def maybe_compact(self) -> None:
        """Squeeze the holes out of a cache that holds mostly holes (kv/ragged.py `maybe_compact`):
        the target's, and the draft's while it holds rows."""
        self.target.maybe_compact()
        if self.draft is not None and self.draft_rows:
            self.draft.maybe_compact()
