"""Rows that start from a cached prefix, and rows that leave theirs for the next ones.

`PrefixReuse` is a component `BatchedSpeculativeEngine` (engine.py) holds (`engine.prefixes`),
the prefix part of its KV manager; it holds no engine. It owns the store and the engine's
namespace; the engine owns the caches and the rows and hands it what a call needs: a newcomer
and the caches it gets its rows in (`open_rows`: the prefill lane's, or the batch's in the
shared prefill mode), a row and where its cache rows are (`offer`), or the rows of a pair of
caches in cache-row order (`offer_rows`, `offer_prefilled_prompts`: where rows leave, and the
shared mode's rows whose prompt is now cached). The store is the device's `PrefixCache`
(kv/prefix_cache.py), shared by the engines of one process; each engine's blocks live under its
own namespace (its model pair), and a request's `cache_scope` (the tenant, with per-tenant
isolation) splits it further, so nothing is shared across models, versions or isolated tenants.
Without a store (None, or a 0-byte one) every call leaves the rows as they are: newcomers get
empty cache rows and nothing is offered.

Adoption: a newcomer looks up its context (prompt and any resumed tokens) and adopts the
longest cached run of blocks that carries what its drafter needs — the target's keys and
values always, the draft's for a `draft_model` row, the DSpark drafter's context for a DSpark
row — leaving at least one token to prefill (the forward that gives its first token, or its
features). Its cache rows start with those keys and values, `prefilled` (and the draft's
`draft_synced`) start at the adopted length, and the prefill feeds only the rest: the same
tokens as without the cache, at the same positions, so its output is the same (the adopted
keys were computed by another forward shape, which may change low bits, as a different
prefill chunk does).

Storing: a row offers its context's keys and values when its prompt is prefilled (so sessions
arriving together with one system prompt share it from the second on) and when it leaves the
batch (so the next turn of a chat finds the reply too). Only blocks not cached yet are copied.
A row that ended in an error offers nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from inference.engine.batch.feature_rows import reads_features
from inference.engine.batch.rows import FINISH_ERROR, BatchRow
from inference.engine.kv.prefix_cache import PrefixCache, PrefixSource
from inference.engine.kv.ragged import RaggedCache


class PrefixReuse:
    """Adopts cached prefixes for newcomers and stores what rows computed (module docstring).

    store: the device's prefix cache (None or a 0-byte one: off); namespace: this engine's part
    of it (the model pair)."""

    def __init__(self, store: PrefixCache | None, namespace: Hashable) -> None:
        self.store = store if store is not None and store.enabled else None
        self.namespace = namespace

    def namespace_of(self, row: BatchRow) -> Hashable:
        """Where the row's blocks live in the store: this engine's namespace, the row's cache scope."""
        return (self.namespace, row.request.cache_scope)

    def open_rows(self, row: BatchRow, target_cache: RaggedCache, draft_cache: RaggedCache | None,
                  prefill_end: int) -> None:
        """Give a newcomer its row in `target_cache` (and in `draft_cache`, a `draft_model` row's),
        starting with the longest cached prefix of its first `prefill_end - 1` context tokens."""
        match = None
        if self.store is not None and prefill_end > 1 and row.prefilled == 0:
            match = self.store.match(self.namespace_of(row), row.context, prefill_end - 1,
                                     draft=draft_cache is not None, features=reads_features(row))
        if match is None:
            target_cache.add_row()
            if draft_cache is not None:
                draft_cache.add_row()
            return
        target_cache.add_row_with(match.target, match.length)
        if draft_cache is not None:
            draft_cache.add_row_with(match.draft, match.length)
            row.draft_synced, row.draft_extra = match.length, []
        if match.features is not None:
            row.drafter.adopt_context(match.features, match.length)
        row.prefilled = match.length
        if not row.stats.preemptions:  # a preempted row's re-prefill is not its prompt's (engine._preempt)
            row.stats.cached_tokens = match.length

    def offer_prefilled_prompts(self, rows: Sequence[BatchRow], target_cache: RaggedCache,
                                draft_rows: Sequence[BatchRow], draft_cache: RaggedCache | None) -> None:
        """Offer the prompt of every row that finished prefilling since (the shared prefill mode,
        where prompts are fed in the decoding rows' forward); `rows`, `draft_rows`: as `offer_rows`."""
        self.offer_rows(rows, target_cache, draft_rows, draft_cache,
                        lambda row: not row.prefix_offered and not row.prefilling)

    def offer_rows(self, rows: Sequence[BatchRow], target_cache: RaggedCache, draft_rows: Sequence[BatchRow],
                   draft_cache: RaggedCache | None, chosen: Callable[[BatchRow], bool]) -> None:
        """Offer the prefix of each row of `rows` that `chosen` picks, in cache-row order: row i of
        `target_cache` is rows[i], row j of `draft_cache` is draft_rows[j]."""
        if self.store is None:
            return
        for index, row in enumerate(rows):
            if chosen(row):
                draft_index = draft_rows.index(row) if row in draft_rows else None
                self.offer(row, target_cache, index, draft_cache, draft_index)

    def offer(self, row: BatchRow, target_cache: RaggedCache, target_index: int,
              draft_cache: RaggedCache | None = None, draft_index: int | None = None) -> None:
        """Store the row's cached context tokens (those the caches hold for its sequence: row
        `target_index` of `target_cache`, row `draft_index` of `draft_cache`) that the store lacks."""
        if self.store is None:
            return
        row.prefix_offered = True
        if row.finish_reason == FINISH_ERROR:
            return
        store = self.store
        block = store.block
        length = min(row.cached, int(target_cache.slots[target_index].sum()))
        length -= length % block
        if length == 0:
            return
        tokens = row.context[:length]
        namespace = self.namespace_of(row)
        draft_length = 0
        if draft_cache is not None and draft_index is not None:
            draft_length = min(row.draft_synced, length, int(draft_cache.slots[draft_index].sum()))
            draft_length -= draft_length % block
        feature_length = 0
        if reads_features(row):
            feature_length = min(row.drafter.context.length, length)
            feature_length -= feature_length % block
        # blocks with everything this row could add are skipped; one lacking only the draft's
        # (or the features') is offered again for them
        start = store.cached_length(namespace, tokens, draft=draft_length > 0, features=feature_length > 0)
        if start >= length:
            return
        store.store(namespace, PrefixSource(
            tokens, target_cache.row_prefix(target_index, length, start), start,
            draft_cache.row_prefix(draft_index, draft_length, start) if draft_length > start else None,
            draft_length,
            row.drafter.context_prefix(feature_length, start) if feature_length > start else None,
            feature_length))
