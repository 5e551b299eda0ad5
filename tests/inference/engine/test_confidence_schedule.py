"""The prefix scheduler of confidence-scheduled verification, on hand-computed cases.

schedule_prefixes admits (row, position) pairs by survival, highest first, while the expected
tokens per second grow, and stops at the first drop; the costs are what the forward will cost
(padded to the widest row, or packed). Also: cutting a draft tree to a prefix, and survival
estimates that never look at the token they decide about.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.engine.batch.confidence_schedule import (
    PackedForwardCost,
    PaddedForwardCost,
    chain_tokens,
    schedule,
    schedule_levels,
    schedule_prefixes,
)
from inference.engine.batch.policy import SpeculationPolicy
from inference.engine.batch.survival import ChainCalibration, SurvivalEstimates
from inference.engine.decode.draft_tree import DraftTree, survival_from_confidences


def _linear(per_token: float):
    """A step costing 1 plus `per_token` per verified draft token (a packed forward)."""
    return lambda lengths: 1.0 + per_token * sum(lengths)


def test_admits_while_throughput_grows_and_stops_at_the_first_drop():
    # start: tau = 2 rows' own tokens over 1.0 s. (0,1) 0.9: 2.9 / 1.3 = 2.23 > 2, admitted;
    # (1,1) 0.6: 3.5 / 1.6 = 2.19 < 2.23, the first drop: stop, (0,2) is never looked at
    schedule = schedule_prefixes([[0.9, 0.2], [0.6]], _linear(0.3))
    assert schedule.lengths == [1, 0]
    assert schedule.expected_tokens == pytest.approx(2.9)
    assert schedule.seconds == pytest.approx(1.3)
    assert schedule.expected_accepted == pytest.approx([0.9, 0.0])


def test_never_looks_past_the_first_drop_even_where_a_later_cut_would_pay_more():
    # a third token is free (a forward that costs by pairs of tokens): admitting all three
    # pairs gives 3.7 / 1.6 = 2.31, more than the 2.23 of the schedule, but reaching it would
    # mean deciding about (1,1) from (0,2), whose estimate depends on row 0's token at 1
    steps = {0: 1.0, 1: 1.3, 2: 1.6, 3: 1.6}

    def stepped(lengths):
        return steps[sum(lengths)]

    assert (2 + 0.9 + 0.6 + 0.2) / 1.6 > 2.9 / 1.3
    assert schedule_prefixes([[0.9, 0.2], [0.6]], stepped).lengths == [1, 0]


def test_all_zero_survival_verifies_nothing_even_when_verifying_is_free():
    assert schedule_prefixes([[0.0, 0.0], [0.0]], lambda lengths: 1.0).lengths == [0, 0]
    assert schedule_prefixes([[0.0] * 4] * 3, _linear(0.0)).lengths == [0, 0, 0]


def test_a_cheap_forward_admits_every_position():
    survival = [[0.9, 0.5, 0.1], [0.3], [0.05, 0.01]]
    schedule = schedule_prefixes(survival, lambda lengths: 1.0)
    assert schedule.lengths == [3, 1, 2]
    assert schedule.expected_tokens == pytest.approx(3 + sum(sum(row) for row in survival))


def test_a_dear_forward_admits_nothing():
    assert schedule_prefixes([[0.99, 0.98], [0.97]], _linear(2.0)).lengths == [0, 0]


def test_prefixes_are_contiguous_a_later_position_never_outranks_an_earlier_one():
    # row 0's second estimate above its first reads as the first (a prefix cannot survive
    # more often than its own prefix); ties go to the lower position, then the lower row
    schedule = schedule_prefixes([[0.5, 0.9], [0.5]], _linear(0.0))
    assert schedule.lengths == [2, 1]
    # a forward that pays for exactly two pairs at 0.3: (0,1) and (1,1) tie with (0,2) at 0.3,
    # the lower position first
    steps = {0: 1.0, 1: 1.0, 2: 1.0, 3: 10.0}
    schedule = schedule_prefixes([[0.3, 0.3], [0.3]], lambda lengths: steps[sum(lengths)])
    assert schedule.lengths == [1, 1]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(rows=st.lists(st.lists(st.floats(0.0, 1.0), max_size=6), min_size=1, max_size=6),
       per_token=st.floats(0.0, 1.0), fixed=st.floats(0.1, 2.0))
def test_the_admitted_pairs_are_the_top_of_the_order_and_each_one_paid(rows, per_token, fixed):
    survival = [sorted(row, reverse=True) for row in rows]
    schedule = schedule_prefixes(survival, lambda lengths: fixed + per_token * sum(lengths))
    admitted = [survival[r][j] for r, length in enumerate(schedule.lengths) for j in range(length)]
    left = [survival[r][length] for r, length in enumerate(schedule.lengths) if length < len(survival[r])]
    assert all(length <= len(row) for length, row in zip(schedule.lengths, survival))
    if admitted and left:
        assert min(admitted) >= max(left)
    # replaying the admissions in order, tau / seconds grew strictly at every one
    tau, cost = float(len(survival)), fixed
    for count, value in enumerate(sorted(admitted, reverse=True), start=1):
        assert (tau + value) / (fixed + per_token * count) > tau / cost
        tau, cost = tau + value, fixed + per_token * count


def test_padded_cost_a_token_on_a_narrower_row_is_free():
    def forward(rows, width):
        return 1.0 + 0.1 * rows * width

    survival = [[0.9, 0.8], [0.05, 0.04]]
    padded = PaddedForwardCost(forward, 2, [chain_tokens(2), chain_tokens(2)])
    # row 0 widens the forward to 3 (2.31 tokens/s); row 1's tokens then ride in its padding
    assert schedule_prefixes(survival, padded).lengths == [2, 2]
    assert padded([2, 0]) == padded([2, 2]) == pytest.approx(1.6)
    # packed, row 1's tokens cost their own compute: 3.75 / 1.5 < 3.7 / 1.4
    packed = PackedForwardCost(forward, 2, [chain_tokens(2), chain_tokens(2)])
    assert schedule_prefixes(survival, packed).lengths == [2, 0]


def test_under_padding_a_level_pays_where_no_single_pair_can():
    """8 rows, a verify column costing 15 % of a step: one pair of 0.9 (+11 % tokens) never
    pays for the column every row gets, the whole level (+90 %) does: the pair rule verifies
    nothing, the level rule (what `schedule` uses for a padded forward) two levels."""
    def forward(rows, width):
        return 1.0 + 0.15 * (width - 1)

    survival = [[0.9, 0.81]] * 8
    padded = PaddedForwardCost(forward, 8, [chain_tokens(2)] * 8)
    assert schedule_prefixes(survival, padded).lengths == [0] * 8
    # level 1: 15.2 / 1.15 = 13.2 > 8; level 2: 21.68 / 1.3 = 16.7 > 13.2
    levels = schedule(survival, padded)
    assert levels.lengths == [2] * 8
    assert levels.expected_tokens == pytest.approx(8 + 8 * (0.9 + 0.81))
    assert levels == schedule_levels(survival, padded)
    # a packed cost goes pair by pair
    packed = PackedForwardCost(forward, 8, [chain_tokens(2)] * 8)
    assert schedule(survival, packed) == schedule_prefixes(survival, packed)


def test_the_level_rule_stops_at_the_first_level_that_does_not_pay_and_skips_worthless_rows():
    def forward(rows, width):
        return 1.0 + 0.5 * (width - 1)

    # level 1: (3 + 0.9 + 0.8) / 1.5 = 3.13 > 3; level 2: (4.7 + 0.5) / 2.0 = 2.6: the drop
    survival = [[0.9, 0.5], [0.8], [0.0, 0.0]]
    padded = PaddedForwardCost(forward, 3, [chain_tokens(2), chain_tokens(1), chain_tokens(2)])
    assert schedule_levels(survival, padded).lengths == [1, 1, 0]
    # a row outside the schedule already 3 wide: both levels ride in its padding
    wide = PaddedForwardCost(forward, 4, [chain_tokens(2), chain_tokens(1), chain_tokens(2)], floor_width=3)
    assert schedule_levels(survival, wide, base_tokens=4).lengths == [2, 1, 0]
    assert schedule_levels([[0.0, 0.0]], wide).lengths == [0]


def test_with_packed_linear_layers_an_unlikely_pair_pays_its_own_compute_and_stays_out():
    def forward(rows, tokens):
        return 1.0 + 0.1 * rows * tokens

    survival = [[0.9], [0.05]]
    # half the forward packed: row 0 alone, 2.9 / 1.35 = 2.15; with row 1 too, 2.95 / 1.4 = 2.11
    partly = PaddedForwardCost(forward, 2, [chain_tokens(1)] * 2, packed_share=0.5)
    assert partly([1, 0]) == pytest.approx(1.35) and partly([1, 1]) == pytest.approx(1.4)
    assert schedule(survival, partly).lengths == [1, 0]
    # all of it padded, row 1's position rides free in row 0's column
    assert schedule(survival, PaddedForwardCost(forward, 2, [chain_tokens(1)] * 2)).lengths == [1, 1]
    # rows outside the schedule count their real tokens in the packed share
    beside = PaddedForwardCost(forward, 3, [chain_tokens(1)] * 2, floor_width=4, packed_share=0.5,
                               other_tokens=4)
    assert beside([0, 0]) == pytest.approx(0.5 * forward(3, 4) + 0.5 * forward(3, 2))


def test_padded_cost_rows_outside_the_schedule_set_the_floor_width_and_fixed_seconds_count():
    def forward(rows, width):
        return 0.1 * rows * width

    # a prefill chunk of 4 beside: drafts up to 3 deep ride in its padding
    wide = PaddedForwardCost(forward, 2, [chain_tokens(3)], floor_width=4)
    assert wide([0]) == wide([3]) == pytest.approx(0.8)
    assert schedule_prefixes([[0.2, 0.1, 0.01]], wide, base_tokens=1).lengths == [3]
    # the drafting already paid makes a wider verify relatively cheaper: 0.15 of survival
    # does not pay for 1.0 -> 1.2 s (1.15 / 1.2 < 1), but does for 3.0 -> 3.2 s
    narrow = PaddedForwardCost(lambda rows, width: 0.8 + 0.2 * width, 1, [chain_tokens(1)])
    assert schedule_prefixes([[0.15]], narrow).lengths == [0]
    sunk = PaddedForwardCost(lambda rows, width: 0.8 + 0.2 * width, 1, [chain_tokens(1)], fixed_seconds=2.0)
    assert schedule_prefixes([[0.15]], sunk).lengths == [1]


def test_a_tree_cut_to_a_prefix_keeps_whole_levels_and_reindexes_parents():
    #        root
    #       /    \
    #      0      1          depth 1
    #     / \      \
    #    2   3      4        depth 2
    #    |
    #    5                   depth 3
    probs = torch.arange(6 * 4, dtype=torch.float64).reshape(6, 4)
    tree = DraftTree([10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 2], [-0.1 * n for n in range(6)], probs,
                     [0.6, 0.3, 0.4, 0.1, 0.2, 0.3])
    assert tree.nodes_up_to(0) == 0 and tree.nodes_up_to(1) == 2 and tree.nodes_up_to(2) == 5
    cut = tree.prefix(2)
    assert cut.token_ids == [10, 11, 12, 13, 14]
    assert cut.parent_ids == [-1, -1, 0, 0, 1]
    assert cut.survival == [0.6, 0.3, 0.4, 0.1, 0.2]
    assert torch.equal(cut.draft_probs, probs[:5])
    assert tree.prefix(1).token_ids == [10, 11] and len(tree.prefix(0)) == 0
    assert tree.prefix(3) is tree
    chain = DraftTree.chain([7, 8, 9], [-0.1, -0.2, -0.3])
    assert chain.prefix(2).token_ids == [7, 8] and chain.prefix(2).is_chain


def test_survival_from_a_tree_sums_each_level_and_from_confidences_is_the_running_product():
    estimates = SurvivalEstimates(SpeculationPolicy())
    tree = DraftTree([10, 11, 12, 13], [-1, -1, 0, 1], [0.0] * 4, None, [0.6, 0.3, 0.4, 0.2])
    assert estimates.of_tree("dspark", tree, sampled=False) == pytest.approx([0.9, 0.6])
    assert survival_from_confidences([0.9, 0.5, 2.0]) == pytest.approx([0.9, 0.45, 0.45])
    chain = DraftTree.chain([1, 2], survival=survival_from_confidences([0.8, 0.5]))
    assert estimates.of_tree("draft_model", chain, sampled=True) == pytest.approx([0.8, 0.4])


def test_draft_model_survival_reads_the_distribution_never_the_drawn_token():
    """Two sampled chains drawn from the same distributions but with different tokens get the
    same estimates: q(x_j) of the drawn token never enters (it would anticipate x_j)."""
    estimates = SurvivalEstimates(SpeculationPolicy())
    q = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]], dtype=torch.float64)
    likely = DraftTree.chain([0, 0], [0.7, 0.4], q)
    unlikely = DraftTree.chain([2, 2], [0.1, 0.25], q)
    assert estimates.of_tree("draft_model", likely, True) == estimates.of_tree("draft_model", unlikely, True)
    first, second = estimates.of_tree("draft_model", likely, True)
    assert 0 < second < first < 1


def test_policy_rows_fall_back_to_the_running_acceptance_per_position():
    policy = SpeculationPolicy()
    for _ in range(50):
        policy.observe_acceptance("ngram", 3, 1)  # position 1 always, position 2 never
    survival = SurvivalEstimates(policy).of_tree("ngram", DraftTree.chain([4, 5, 6]), sampled=False)
    assert survival[0] > 0.9 and survival[1] < 0.1 and survival[2] <= survival[1]


def test_chain_calibration_starts_at_the_prior_learns_overall_fast_and_per_q_in_time():
    calibration = ChainCalibration(prior=0.7)
    assert calibration.rate(0.03) == calibration.rate(0.9) == pytest.approx(0.7)
    for _ in range(12):
        calibration.observe(0.03, True)  # a flat draft whose every token the target takes
    assert calibration.rate(0.03) > 0.95
    assert calibration.rate(0.55) > 0.85  # buckets never observed follow the overall rate
    for _ in range(12):
        calibration.observe(0.95, False)  # a confident draft that is always wrong
    assert calibration.rate(0.95) < 0.2 < 0.9 < calibration.rate(0.03)
