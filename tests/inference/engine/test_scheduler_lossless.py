"""Confidence-scheduled verification keeps the output exact.

1. Non-anticipation (the DSpark paper's Appendix A): in a toy with a 4-token vocabulary, a
   2-token chain is drawn from the draft q, a scheduler decides how much of it to verify, and
   the rejection rule (verify_sampling) emits the first token. With our scheduler, deciding
   from estimates known before the token they decide about, the first token follows the
   target p; with a scheduler that looks at the token it decides about (directly, or through
   a later position's estimate that depends on it) the chi-square test fails.
2. Greedy rows of the batched engine with the scheduler on equal the target's own greedy
   output, whatever the batch (random arrivals, mixed drafters, costs that make it cut).
3. Unseeded sampled rows of a busy batch with the scheduler on follow the target's
   distribution (chi-square on the first two tokens).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.engine import DraftConfig, GenerationConfig
from inference.engine.batch.confidence_schedule import schedule_prefixes
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.batch.policy import SpeculationPolicy
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.sampling import SamplingParams
from inference.engine.decode.target_only import generate_plain
from inference.engine.decode.verify import verify_sampling

from .chi_square import exact_joint, joint_p_value
from .conftest import ARCHS, VOCAB_SIZE, draft_model, noisy_copy, target_model

# -- 1. the toy: non-anticipation ------------------------------------------------------------

# draft q and target p over 4 tokens; token 0 is the draft's favourite, over-proposed
Q1 = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64)
P1 = torch.tensor([0.3, 0.3, 0.2, 0.2], dtype=torch.float64)
FAVOURITE = 0
TRIALS = 6000


def _q2(first: int) -> torch.Tensor:
    """The draft's second position given the first token: confident after the favourite."""
    return (torch.tensor([0.9, 0.05, 0.03, 0.02]) if first == FAVOURITE
            else torch.tensor([0.25, 0.25, 0.25, 0.25])).double()


P2 = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)  # any p at position 2 will do


def _survival(first: int) -> list[float]:
    """Non-anticipating estimates: a_1 from q1's top probability (known before x_1 is drawn),
    a_2 = a_1 * c_2 with c_2 from q2(.|x_1)'s top probability (depends on x_1, not on x_2)."""
    a1 = float(Q1.max())
    return [a1, a1 * float(_q2(first).max())]


def _ours(first: int, second: int) -> int:
    # a step costing 1.0 undrafted, 1.6 to verify 1, 2.0 to verify 2: position 1 always pays
    # (1.7 / 1.6 > 1), position 2 only after the favourite (2.33 / 2.0 > 1.7 / 1.6, where
    # 1.875 / 2.0 after another token is a drop)
    costs = {0: 1.0, 1: 1.6, 2: 2.0}
    return schedule_prefixes([_survival(first)], lambda lengths: costs[lengths[0]]).lengths[0]


def _peeking(first: int, second: int) -> int:
    """Verifies position 1 only when its own token is the favourite."""
    return 2 if first == FAVOURITE else 0


def _best_cut(first: int, second: int) -> int:
    """Picks the best of the cuts 0, 1, 2 by tau / seconds, looking at every candidate: with a
    forward whose width 1 and 2 cost the same, position 1 alone never pays, positions 1 and 2
    together pay only when a_2 (which depends on x_1) is high: the decision about position 1
    reads its own token through a_2."""
    costs = {0: 1.0, 1: 2.0, 2: 2.0}
    survival = _survival(first)
    tau = [1.0, 1.0 + survival[0], 1.0 + survival[0] + survival[1]]
    return max(range(3), key=lambda cut: tau[cut] / costs[cut])


def _first_tokens(decide, seed: int = 0) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros(len(P1))
    for _ in range(TRIALS):
        first = int(torch.multinomial(Q1, 1, generator=generator))
        q2 = _q2(first)
        second = int(torch.multinomial(q2, 1, generator=generator))
        chain = DraftTree.chain([first, second], [0.0, 0.0], torch.stack([Q1, q2]))
        length = decide(first, second)
        tree = chain.prefix(length)
        # [1 + nodes, vocab]: p after the context, after x_1, after x_2
        target = torch.stack([P1, P2, P2])[: 1 + len(tree)]
        result = verify_sampling(tree, target, generator)
        emitted = tree.token_ids[0] if result.accepted_nodes else result.next_token
        counts[emitted] += 1
    return counts


def test_our_scheduler_verifies_variably_yet_the_first_token_follows_the_target():
    lengths = {_ours(first, 0) for first in range(4)}
    assert lengths == {1, 2}  # it does cut, depending on x_1 (which position 2 may read)
    counts = _first_tokens(_ours)
    assert joint_p_value(counts, P1.numpy()) > 1e-3


@pytest.mark.parametrize("anticipating", [_peeking, _best_cut])
def test_a_scheduler_that_looks_at_the_token_it_decides_about_is_biased(anticipating):
    assert {anticipating(first, 0) for first in range(4)} == {0, 2}
    counts = _first_tokens(anticipating)
    assert joint_p_value(counts, P1.numpy()) < 1e-6
    # the same draws verified whole every time are unbiased: the bias is the decision's
    assert joint_p_value(_first_tokens(lambda first, second: 2), P1.numpy()) > 1e-3


# -- 2. greedy rows of the engine: identical output -------------------------------------------


class _SyntheticCosts(SpeculationPolicy):
    """The scheduler's costs from a formula, not from timings: fixed + per token, so the cuts it
    makes do not depend on the machine's speed and some rows verify 0, some all."""

    def __init__(self, per_token: float = 0.04, **options) -> None:
        super().__init__(**options)
        self.per_token = per_token

    def forward_seconds(self, rows: int, tokens: float) -> float:
        return 0.2 + 0.01 * rows + self.per_token * rows * tokens


def _decode(tokens: list[int]) -> str:
    return "".join(f"<{token}>" for token in tokens)


DRAFTERS = ("draft_model", "ngram", "tree", "suffix", "none", "auto")


@st.composite
def batches(draw):
    count = draw(st.integers(2, 7))
    requests, arrivals = [], {}
    for index in range(count):
        prompt = draw(st.lists(st.integers(2, VOCAB_SIZE - 1), min_size=1, max_size=24))
        generation = GenerationConfig(
            max_new_tokens=draw(st.integers(1, 24)),
            eos_token_id=draw(st.sampled_from([None, 1, (1, draw(st.integers(2, VOCAB_SIZE - 1)))])),
        )
        draft = DraftConfig(length=draw(st.integers(1, 6)), tree_width=draw(st.integers(1, 3)),
                            tree_depth=draw(st.integers(1, 4)), node_budget=draw(st.integers(1, 8)))
        requests.append(BatchRequest(index, prompt, generation, draw(st.sampled_from(DRAFTERS)), draft))
        arrivals[index] = draw(st.integers(0, 6))
    return requests, arrivals


@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=batches(), max_rows=st.integers(1, 5), per_token=st.sampled_from([0.0, 0.02, 0.2]),
       prefill=st.sampled_from(["shared", "separate"]), which=st.sampled_from(["noisy", "random"]))
def test_greedy_rows_with_the_scheduler_equal_the_targets_own_greedy(arch, batch, max_rows, per_token,
                                                                     prefill, which):
    requests, arrivals = batch
    draft = noisy_copy(arch) if which == "noisy" else draft_model(arch)
    policy = _SyntheticCosts(per_token, max_depth=6)
    engine = BatchedSpeculativeEngine(target_model(arch), draft, decode=_decode, max_rows=max_rows,
                                      prefill_chunk=8, policy=policy, prefill=prefill)
    assert engine.scheduling
    results = engine.run(requests, arrivals)
    target = target_model(arch)
    for request in requests:
        expected = generate_plain(target, request.prompt_ids, request.config, decode=_decode)
        got = results[request.request_id]
        assert got.token_ids == expected.token_ids, (request.request_id, request.drafter)
        assert got.finish_reason == expected.finish_reason


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_rows_with_the_scheduler_and_packed_linear_layers_equal_the_targets_own_greedy(arch):
    """Under `pack_linear` the scheduler costs the linear layers by real tokens (an unlikely
    row's position no longer rides free) and leaves rows at different lengths: still exact."""
    engine = BatchedSpeculativeEngine(target_model(arch), noisy_copy(arch), decode=_decode, max_rows=5,
                                      policy=_SyntheticCosts(0.05, max_depth=5), pack_linear=True)
    prompts = [[5, 9, 2, 7], [11, 12, 13], [3, 3, 3, 3, 3], [40, 41], [60, 61, 62], [7], [8, 8, 9]]
    kinds = ["draft_model", "ngram", "tree", "suffix", "draft_model", "auto", "ngram"]
    config = GenerationConfig(max_new_tokens=24, eos_token_id=())
    requests = [BatchRequest(index, prompt, config, kind, DraftConfig(length=5))
                for index, (prompt, kind) in enumerate(zip(prompts, kinds))]
    results = engine.run(requests, {index: index for index in range(len(requests))})
    for index, prompt in enumerate(prompts):
        assert results[index].token_ids == generate_plain(target_model(arch), prompt, config).token_ids, index
    assert sum(sum(result.stats.verified_lengths[1:]) for result in results.values()) > 0


def test_the_scheduler_cuts_rows_differently_and_reports_its_estimates_per_row():
    """One batch, every drafter: some steps verify nothing, some cut a draft short, and each
    row's stats and events carry the lengths, the expected and the realised acceptance."""
    arch = "llama"
    engine = BatchedSpeculativeEngine(target_model(arch), noisy_copy(arch), decode=_decode, max_rows=6,
                                      policy=_SyntheticCosts(0.02, max_depth=6))
    prompts = [[5, 9, 2, 7], [11, 12, 13], [3, 3, 3, 3, 3], [40, 41], [60, 61, 62], [7]]
    kinds = ["draft_model", "ngram", "tree", "suffix", "draft_model", "tree"]
    config = GenerationConfig(max_new_tokens=32, eos_token_id=())
    for index, (prompt, kind) in enumerate(zip(prompts, kinds)):
        engine.submit(BatchRequest(index, prompt, config, kind, DraftConfig(length=6)))
    events, stats = [], {}
    while engine.has_work():
        for event in engine.step():
            events.append(event)
            stats[event.request_id] = event.stats
    scheduled = [event for event in events if event.verified_depth is not None]
    assert scheduled and all(event.expected_accepted is not None for event in scheduled)
    assert {event.verified_depth for event in scheduled} > {0}  # some verify, some do not
    assert sum(row.cut_tokens for row in stats.values()) > 0  # drafts were cut short
    for index, row in stats.items():
        assert sum(row.verified_lengths) == row.scheduled_steps > 0, index
        assert row.scheduled_accepted <= sum(length * steps for length, steps in enumerate(row.verified_lengths))
        assert row.to_dict()["survival_calibration"] == row.survival_calibration
        tokens = [token for event in events if event.request_id == index for token in event.step.token_ids]
        assert tokens == generate_plain(target_model(arch), prompts[index], config).token_ids
    # the estimates are about right in total (calibrated online; the noisy draft accepts ~half)
    expected = sum(row.expected_accepted for row in stats.values())
    realised = sum(row.scheduled_accepted for row in stats.values())
    assert 0.3 * expected <= realised <= 3.0 * expected


def test_with_the_policy_disabled_every_row_drafts_its_own_length_unscheduled():
    engine = BatchedSpeculativeEngine(target_model("llama"), noisy_copy("llama"), decode=_decode,
                                      policy=SpeculationPolicy(enabled=False))
    assert not engine.scheduling
    config = GenerationConfig(max_new_tokens=12, eos_token_id=())
    engine.submit(BatchRequest("r", [5, 9, 2], config, "draft_model", DraftConfig(length=3)))
    events = []
    while engine.has_work():
        events += engine.step()
    assert all(event.verified_depth is None and event.expected_accepted is None for event in events)
    assert events[-1].stats.scheduled_steps == 0
    assert max(event.step.drafted for event in events) == 3


# -- 3. sampled rows of the engine: the target's distribution ---------------------------------

VOCAB = 8
PROMPT = [3, 1, 4]


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_sampling_with_the_scheduler_follows_the_target_distribution(kind):
    """1,500 unseeded sampled rows, scheduled (their lengths vary step by step with their
    survival estimates and the batch), beside greedy companions."""
    target, draft = target_model("llama", vocab_size=VOCAB), draft_model("llama", vocab_size=VOCAB)
    policy = _SyntheticCosts(0.01, max_depth=3)
    engine = BatchedSpeculativeEngine(target, draft, max_rows=24, prefill_chunk=4, policy=policy)
    torch.manual_seed(0)
    runs = 1500
    sampled = GenerationConfig(max_new_tokens=3, temperature=1.0, eos_token_id=())
    config = DraftConfig(length=3, ngram_size=1)
    # a repetitive prompt gives the n-gram drafter something to propose
    prompt = PROMPT + PROMPT if kind == "ngram" else PROMPT
    requests = [BatchRequest(("s", run), prompt, sampled, kind, config) for run in range(runs)]
    requests += [BatchRequest(("g", run), [5, 2, 7, 1, 0, 6][: 1 + run % 6],
                              GenerationConfig(max_new_tokens=2 + run % 7), "draft_model", config)
                 for run in range(150)]
    arrivals = {request.request_id: index // 12 for index, request in enumerate(requests)}
    results = engine.run(requests, arrivals)
    counts = np.zeros(VOCAB * VOCAB)
    lengths: dict[int, int] = {}
    for run in range(runs):
        result = results[("s", run)]
        counts[result.token_ids[0] * VOCAB + result.token_ids[1]] += 1
        for length, steps in enumerate(result.stats.verified_lengths):
            lengths[length] = lengths.get(length, 0) + steps
    assert lengths.get(0, 0) > 0 and sum(steps for length, steps in lengths.items() if length) > 0, lengths
    params = SamplingParams(1.0)
    assert joint_p_value(counts, exact_joint(target, prompt, VOCAB, params)) > 1e-3
    assert joint_p_value(counts, exact_joint(draft, prompt, VOCAB, params)) < 1e-6  # negative control


def test_the_one_depth_policy_path_without_the_scheduler_still_samples_exactly():
    """`confidence_scheduling=False` keeps the policy's one depth per step (decide); the busy-
    batch test of test_batch.py now runs the scheduler, so this keeps that path covered."""
    from .test_batch import _ShufflingPolicy

    policy = _ShufflingPolicy()
    policy.confidence_scheduling = False
    target, draft = target_model("llama", vocab_size=VOCAB), draft_model("llama", vocab_size=VOCAB)
    engine = BatchedSpeculativeEngine(target, draft, max_rows=24, prefill_chunk=4, policy=policy)
    assert not engine.scheduling
    torch.manual_seed(1)
    runs = 1500
    sampled = GenerationConfig(max_new_tokens=3, temperature=1.0, eos_token_id=())
    requests = [BatchRequest(("s", run), PROMPT, sampled, "draft_model", DraftConfig(length=2))
                for run in range(runs)]
    results = engine.run(requests, {request.request_id: index // 12 for index, request in enumerate(requests)})
    counts = np.zeros(VOCAB * VOCAB)
    for run in range(runs):
        tokens = results[("s", run)].token_ids
        counts[tokens[0] * VOCAB + tokens[1]] += 1
        assert results[("s", run)].stats.scheduled_steps == 0
    assert sum(results[("s", run)].stats.drafted for run in range(runs)) > 0
    params = SamplingParams(1.0)
    assert joint_p_value(counts, exact_joint(target, PROMPT, VOCAB, params)) > 1e-3
