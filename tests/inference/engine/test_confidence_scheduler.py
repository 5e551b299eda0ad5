"""The confidence scheduler (batch/scheduling.py) on its own: no engine, no model, only rows.

`ConfidenceScheduler` is handed the rows, each one's new tokens, its depth cap and its drafts;
these properties hold for any batch it is handed:
- it schedules exactly the decoding rows of the policy that draft (not a seeded sampled row,
  not one still feeding its prompt, not a `none` row), and plans no depth for the others;
- a per-row drafter drafts while its running acceptance pays for a position (the floor the
  docstring of scheduling.py defines), at least one position and at most its cap;
- a cut keeps a prefix of each scheduled draft, reads no drafted token (the same drafts with
  other tokens get the same lengths: what keeps sampling exact) and leaves other rows' drafts;
- the chains a shared draft forward extends are the most likely ones, after every row outside
  the schedule; an exploring step drafts and verifies one position per scheduled row.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.engine import DraftConfig, GenerationConfig
from inference.engine.batch.policy import SpeculationPolicy
from inference.engine.batch.rows import BatchRequest, BatchRow
from inference.engine.batch.scheduling import ConfidenceScheduler
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.stopping import StopCondition

CHUNK = 8
KINDS = ("draft_model", "ngram", "tree", "suffix", "none")
MODES = ("greedy", "unseeded", "seeded")


class _Formula:
    """A cost model of fixed + per-token seconds that learns nothing."""

    observations = 1

    def __init__(self, fixed: float, per_token: float) -> None:
        self.fixed, self.per_token = fixed, per_token

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        pass

    def estimate(self, rows: int, tokens: float) -> float:
        return self.fixed + self.per_token * rows * tokens if rows > 0 and tokens > 0 else 0.0


class _Policy(SpeculationPolicy):
    def __init__(self, per_token: float, draft_fixed: float, row_seconds: float = 0.002,
                 history: tuple = (), **options) -> None:
        super().__init__(**options)
        self.per_token = per_token
        self.draft_costs = _Formula(draft_fixed, 0.001)
        self.row_draft_seconds = {"ngram": 2e-5, "tree": row_seconds, "suffix": row_seconds / 2}
        for kind, sampled, depth, accepted in history:  # what earlier steps accepted
            self.observe_acceptance(kind, depth, min(accepted, depth), sampled)

    def forward_seconds(self, rows: int, tokens: float) -> float:
        return 0.2 + 0.01 * rows + self.per_token * rows * tokens


def _row(index: int, kind: str, mode: str, prefilling: bool, room: int) -> BatchRow:
    config = GenerationConfig(max_new_tokens=room + 1, eos_token_id=(),
                              temperature=0.0 if mode == "greedy" else 1.0,
                              seed=7 if mode == "seeded" else None)
    request = BatchRequest(index, [5, 9, 2] * 8, config, kind, DraftConfig())
    row = BatchRow(request, kind, room + 1, StopCondition(config, room + 1, None), torch.device("cpu"))
    row.prefilled = 0 if prefilling else row.prompt_length
    return row


# (drafter, greedy/unseeded/seeded sampling, still prefilling, tokens left after the next)
row_specs = st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(MODES), st.booleans(),
                               st.integers(0, 7)), min_size=1, max_size=6)
# mostly rows a per-row drafter runs for the scheduler, with room to draft deep
per_row_specs = st.lists(st.tuples(st.sampled_from(("ngram", "tree", "suffix", "ngram", "tree", "draft_model", "none")),
                                   st.sampled_from(("greedy", "greedy", "unseeded", "seeded")),
                                   st.sampled_from((False, False, False, True)), st.integers(2, 7)),
                         min_size=1, max_size=6)
history = st.lists(st.tuples(st.sampled_from(KINDS[1:4]), st.booleans(), st.integers(1, 6), st.integers(0, 6)),
                   max_size=40)


def policies(max_depth: st.SearchStrategy = st.integers(1, 7)) -> st.SearchStrategy:
    return st.fixed_dictionaries({"per_token": st.sampled_from([0.0, 0.005, 0.02, 0.05, 0.1, 0.2]),
                                  "draft_fixed": st.sampled_from([0.0, 0.01, 0.05, 0.3]),
                                  "row_seconds": st.sampled_from([0.0, 0.002, 0.02, 0.1]),
                                  "history": history, "max_depth": max_depth})


# a batch of draft_model chains, most of them scheduled
chain_specs = st.lists(st.tuples(st.just("draft_model"), st.sampled_from(("greedy", "greedy", "unseeded", "seeded")),
                                 st.just(False), st.integers(1, 7)), min_size=2, max_size=6)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _planned(specs, options, explore_after: int | None = None):
    """A fresh scheduler, its rows and the deepest depth of its plan for them."""
    policy = _Policy(explore_after=explore_after, **options)
    scheduler = ConfidenceScheduler(policy)
    rows = [_row(index, *spec) for index, spec in enumerate(specs)]
    new_tokens = [len(row.context) - row.cached if not row.prefilling else min(CHUNK, row.prompt_length)
                  for row in rows]
    deepest = scheduler.plan(rows, [row for row in rows if row.drafter_kind == "draft_model"], CHUNK,
                             new_tokens, _cap(policy), scheduler.depth)
    return scheduler, rows, new_tokens, deepest


def _cap(policy: SpeculationPolicy):
    return lambda row: 0 if row.drafter_kind == "none" else max(0, min(row.room, policy.max_depth))


def _is_scheduled(row: BatchRow) -> bool:
    return not row.prefilling and not row.own_schedule and row.drafter_kind != "none"


@SETTINGS
@given(specs=per_row_specs, options=policies(st.integers(3, 7)))
def test_a_per_row_drafter_drafts_while_its_running_acceptance_pays(specs, options):
    scheduler, rows, new_tokens, deepest = _planned(specs, options)
    policy = scheduler.policy
    # the rates a position is weighed against (module docstring, 1.)
    depth, width = max(1, policy.max_depth), max([1, *new_tokens])
    undrafted = policy.forward_seconds(len(rows), width)
    token_rate = len(rows) / undrafted
    verify_per_token = (policy.forward_seconds(len(rows), max(width, depth + 1)) - undrafted) / (depth * len(rows))
    for row in rows:
        assert scheduler.scheduled(row) == _is_scheduled(row)
        planned, cap = scheduler.depth(row), _cap(policy)(row)
        if not _is_scheduled(row):
            assert planned == 0
            continue
        if row.drafter_kind == "draft_model":
            assert planned in (0, cap) and row.confidence_of is not None
            continue
        assert min(cap, 1) <= planned <= cap
        tracker = policy.tracker(row.drafter_kind, row.sampling is not None)
        floor = token_rate * (policy.row_draft_seconds.get(row.drafter_kind, 0.0) + verify_per_token)
        survival = [math.prod(tracker.rate(position) for position in range(end + 1)) for end in range(cap)]
        assert all(value >= floor for value in survival[1:planned])
        assert planned == cap or survival[planned] < floor
    assert deepest == max(scheduler.depth(row) for row in rows)


def _trees(rows: list[BatchRow], scheduler: ConfidenceScheduler, log_probs: list[float], token: int):
    """A chain per drafting row, as deep as it was planned (a draft_model chain: its cap)."""
    trees = []
    for index, row in enumerate(rows):
        depth = scheduler.depth(row) if scheduler.scheduled(row) else min(2, row.room)
        depth = 0 if row.drafter_kind == "none" or row.prefilling else depth
        trees.append(DraftTree.chain([token + index + position for position in range(depth)],
                                     log_probs[:depth] + [-1.0] * (depth - len(log_probs))))
    return trees


@SETTINGS
@given(specs=row_specs, options=policies(),
       log_probs=st.lists(st.floats(-6.0, 0.0), min_size=7, max_size=7))
def test_a_cut_keeps_a_prefix_of_each_scheduled_draft_and_reads_no_token(specs, options, log_probs):
    results = []
    for token in (3, 40):  # the same drafts but for their token ids
        scheduler, rows, new_tokens, _ = _planned(specs, options)
        trees = _trees(rows, scheduler, log_probs, token)
        cut, decision = scheduler.cut(rows, trees, CHUNK, new_tokens, _cap(scheduler.policy))
        for row, tree, kept in zip(rows, trees, cut):
            if not scheduler.scheduled(row):
                assert kept is tree and row.scheduled_expected is None
                continue
            assert kept.token_ids == tree.token_ids[:len(kept)]
            assert row.scheduled_cut == len(tree) - len(kept)
            estimates = scheduler.survival.of_tree(row.drafter_kind, tree, row.sampling is not None)
            assert row.scheduled_expected == pytest.approx(sum(estimates[:len(kept)]))
        assert decision.depth == max((len(kept) for row, kept in zip(rows, cut) if scheduler.scheduled(row)),
                                     default=0)
        results.append(([len(kept) for kept in cut], decision))
    assert results[0] == results[1]


@SETTINGS
@given(specs=chain_specs, options=policies(),
       predicted=st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6))
def test_a_draft_forward_extends_the_rows_outside_the_schedule_then_the_likeliest_chains(specs, options,
                                                                                        predicted):
    scheduler, rows, _, _ = _planned(specs, options)
    chains = [row for row in rows if row.drafter_kind == "draft_model"]
    for row, value in zip(chains, predicted):
        row.draft_survival, row.last_confidence = value, 1.0
    indices = list(range(10, 10 + len(chains)))
    extended = scheduler.extend_chains(chains, indices)
    fixed = [index for row, index in zip(chains, indices) if not scheduler.scheduled(row)]
    assert extended[:len(fixed)] == fixed
    by_index = dict(zip(indices, chains))
    chosen = [by_index[index].draft_survival for index in extended[len(fixed):]]
    assert chosen == sorted(chosen, reverse=True)
    left = [row.draft_survival for row, index in zip(chains, indices)
            if scheduler.scheduled(row) and index not in extended]
    assert not chosen or not left or min(chosen) >= max(left)
    scheduler.policy.confidence_scheduling = False  # off: every chain goes on
    assert scheduler.extend_chains(chains, indices) == indices


@SETTINGS
@given(specs=row_specs, options=policies())
def test_an_exploring_step_drafts_and_verifies_one_position_per_scheduled_row(specs, options):
    scheduler, rows, new_tokens, _ = _planned(specs, options, explore_after=0)
    scheduled = [row for row in rows if scheduler.scheduled(row)]
    cap = _cap(scheduler.policy)
    assert all(scheduler.depth(row) == min(1, cap(row)) for row in scheduled)
    indices = list(range(len(rows)))
    assert scheduler.extend_chains(rows, indices) == indices
    # drafts no scheduler would verify (survival 0): each drafted scheduled row verifies one
    trees = [DraftTree.chain([4] * scheduler.depth(row), survival=[0.0] * scheduler.depth(row))
             if row in scheduled else DraftTree.empty() for row in rows]
    cut, decision = scheduler.cut(rows, trees, CHUNK, new_tokens, cap)
    assert decision.explored == bool(scheduled)
    assert [len(tree) for tree in cut] == [len(tree) for tree in trees]


def test_only_a_scheduled_rows_verdict_teaches_the_chain_calibration():
    scheduler = ConfidenceScheduler(_Policy(0.02, 0.05))
    row = _row(0, "draft_model", "greedy", False, 6)
    chain = DraftTree.chain([4, 5, 6], [math.log(0.9), math.log(0.6), math.log(0.3)])
    scheduler.observe(row, chain, 1)  # not scheduled this step: nothing learnt
    assert sum(scheduler.survival.greedy_chain.trials) == 0 and row.stats.scheduled_steps == 0
    row.scheduled_expected, row.scheduled_cut = 1.2, 0
    scheduler.observe(row, chain, 1)  # the accepted position and the first rejected one
    assert sum(scheduler.survival.greedy_chain.trials) == 2
    assert sum(scheduler.survival.greedy_chain.hits) == 1
    assert row.stats.scheduled_steps == 1 and row.stats.scheduled_accepted == 1
