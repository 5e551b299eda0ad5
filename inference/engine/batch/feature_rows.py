"""Rows whose drafter reads the target's own features (DSpark), in the batched engine.

A mixin of `BatchedSpeculativeEngine` (engine.py). The target's hidden states at the DSpark
checkpoint's layers are captured from the forwards the engine runs anyway — the prefill lane's,
and the step's verify forward (features.py: `tapped`) — and each feature row is handed the
features of exactly the positions that forward committed for it: every context token it fed (a
prompt chunk or its pending token) and its accepted draft nodes, never a rejected node (so
there is nothing to roll back: a rejected node's slot becomes a hole in the target's cache and
never reaches the drafter). Rows are left-aligned in a ragged forward (kv/ragged.py), so row i's
tokens are positions 0..len-1 of row i in the captured tensor.

Drafting: the feature rows draft their blocks in one backbone forward (dspark/batched.py); a
seeded sampled row drafts alone so its tokens never depend on its companions.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from inference.engine.batch.rows import BatchRow
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.drafters.base import DraftRequest
from inference.engine.drafters.dspark.batched import drafts_alone, propose_blocks
from inference.engine.kv.ragged import RowInput
from inference.engine.lm.features import FeatureTap, tapped


class RunnerTap:
    """The features of the runner's last forward, where a `FeatureTap` would collect them."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def features(self) -> torch.Tensor:
        """[rows, new_tokens, taps * hidden]"""
        if self.runner.last_features is None:
            raise RuntimeError("the forward returned no features")
        return self.runner.last_features


def reads_features(row: BatchRow) -> bool:
    return hasattr(row.drafter, "observe_target_features")


class FeatureRows:
    """Feeds feature rows their committed positions' features; drafts their blocks together."""

    @contextmanager
    def _tapping(self, rows: list[BatchRow]) -> Iterator[FeatureTap | None]:
        """Capture the target's features during the forward inside, when a row in `rows` reads them."""
        layers = next((row.drafter.target_layer_ids for row in rows if reads_features(row)), None)
        if layers and self.runners.target is not None:  # the static forward returns them (runner/)
            yield RunnerTap(self.runners.target)
            return
        with tapped(self.target, layers) as tap:
            yield tap

    @staticmethod
    def _hand_over(tap: FeatureTap | None, rows: list[BatchRow], inputs: list[RowInput],
                   committed: list[list[int] | None]) -> None:
        """Give row i the features at its input indices `committed[i]` (None: it takes none)."""
        if tap is None:
            return
        features = tap.features()
        for index, (row, kept) in enumerate(zip(rows, committed)):
            if kept is None or not reads_features(row) or not kept:
                continue
            row.drafter.observe_target_features(features[index, kept][None])

    def _draft_feature_rows(self, depths: dict[int, int]) -> dict[int, DraftTree]:
        """The blocks of every feature row asking for a positive depth, batched where they may be."""
        rows = [row for row in self.rows if reads_features(row) and depths.get(id(row), 0) > 0]
        trees: dict[int, DraftTree] = {}
        together = []
        for row in rows:
            request = DraftRequest(depths[id(row)], row.sampling, row.generator)
            if drafts_alone(request, row.config.seed is not None):
                started = time.perf_counter()
                trees[id(row)] = row.drafter.propose(row.context, request)
                self.policy.observe_row_draft(row.drafter_kind, request.max_depth, time.perf_counter() - started)
            else:
                together.append((row, request))
        if together:
            started = time.perf_counter()
            with torch.inference_mode():
                blocks = propose_blocks([row.drafter for row, _ in together], [row.context for row, _ in together],
                                        [request for _, request in together], self.runners.dspark)
            seconds = time.perf_counter() - started
            for (row, request), tree in zip(together, blocks):
                trees[id(row)] = tree
            self.policy.observe_row_draft("dspark", max(r.max_depth for _, r in together), seconds)
        return trees
