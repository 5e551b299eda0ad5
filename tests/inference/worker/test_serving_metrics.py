"""inference/worker/metrics.py: what each observe_* call adds to prometheus_client's registry.

The registry is process-wide and other tests feed it too, so every test reads a sample before
and after its calls and checks the difference, under label values no other test uses.
"""
from __future__ import annotations

import uuid

import pytest
from prometheus_client import REGISTRY

from inference.worker import metrics
from inference.worker.metrics import (
    MAX_POSITION,
    inter_token_gaps,
    observe_forward,
    observe_generation,
    observe_policy_decision,
    observe_request,
    observe_schedule,
    observe_step_costs,
    observe_speculation,
    observe_writer_backlog,
)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def label_values(name: str, label: str, **fixed: str) -> set[str]:
    """The values of ``label`` among ``name``'s samples that carry the ``fixed`` labels."""
    values = set()
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in fixed.items()):
                values.add(s.labels[label])
    return values


@pytest.fixture
def drafter() -> str:
    """A drafter label no other test uses, so counts start from zero."""
    return f"test-{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------------------- requests

def test_observe_request_fills_the_four_histograms_per_model_and_drafter(drafter):
    labels = {"model": "tiny@1", "drafter": drafter}
    observe_request("tiny@1", drafter, "succeeded", queue_seconds=0.2, ttft_seconds=0.6,
                    inter_token_seconds=[0.01, 0.02, 0.2], e2e_seconds=1.5, new_tokens=4)
    observe_request("tiny@1", drafter, "failed", queue_seconds=None, ttft_seconds=None,
                    inter_token_seconds=[], e2e_seconds=0.05, new_tokens=0)

    assert sample("specops_request_queue_time_seconds_count", **labels) == 1  # the failure never queued
    assert sample("specops_request_queue_time_seconds_sum", **labels) == pytest.approx(0.2)
    assert sample("specops_time_to_first_token_seconds_count", **labels) == 1
    assert sample("specops_time_to_first_token_seconds_bucket", **labels, le="0.5") == 0
    assert sample("specops_time_to_first_token_seconds_bucket", **labels, le="1.0") == 1
    assert sample("specops_inter_token_latency_seconds_count", **labels) == 3
    assert sample("specops_inter_token_latency_seconds_bucket", **labels, le="0.1") == 2
    assert sample("specops_e2e_request_latency_seconds_count", **labels, status="succeeded") == 1
    assert sample("specops_e2e_request_latency_seconds_count", **labels, status="failed") == 1
    assert sample("specops_generation_tokens_total", drafter=drafter) == 4


def test_the_slo_thresholds_are_bucket_edges():
    """histogram_quantile is exact at an edge: the alerts' thresholds must be edges."""
    assert metrics.TTFT_SLO_SECONDS in metrics.TTFT_BUCKETS
    assert metrics.ITL_SLO_SECONDS in metrics.ITL_BUCKETS
    for buckets in (metrics.TTFT_BUCKETS, metrics.ITL_BUCKETS, metrics.QUEUE_BUCKETS, metrics.E2E_BUCKETS,
                    metrics.ROWS_BUCKETS, metrics.TOKENS_BUCKETS, metrics.FORWARD_BUCKETS):
        assert list(buckets) == sorted(set(buckets))


def test_inter_token_gaps_share_a_step_gap_between_its_tokens():
    # First step at t=1 (1 token: the TTFT), then 3 tokens at t=4 and 2 tokens at t=6.
    assert inter_token_gaps([1.0, 4.0, 6.0], [1, 3, 2]) == [1.0] * 5
    # A step that streamed nothing passes its time on to the next one.
    assert inter_token_gaps([1.0, 2.0, 3.0], [2, 0, 1]) == [2.0]
    assert inter_token_gaps([0.5], [4]) == []
    assert inter_token_gaps([], []) == []
    with pytest.raises(ValueError, match="step_tokens"):
        inter_token_gaps([1.0, 2.0], [1])


# ---------------------------------------------------------------------------- forwards

def test_observe_forward_counts_rows_and_tokens_per_kind():
    before = {(kind, name): sample(name, kind=kind) for kind in ("target", "draft")
              for name in ("specops_batch_rows_count", "specops_batch_rows_sum",
                           "specops_batch_tokens_per_forward_sum", "specops_forward_seconds_count")}
    observe_forward("target", rows=8, tokens=40, seconds=0.0188)
    observe_forward("target", rows=16, tokens=16, seconds=0.0126)
    observe_forward("draft", rows=8, tokens=8, seconds=0.002)

    def delta(kind: str, name: str) -> float:
        return sample(name, kind=kind) - before[(kind, name)]

    assert delta("target", "specops_batch_rows_count") == 2
    assert delta("target", "specops_batch_rows_sum") == 24
    assert delta("target", "specops_batch_tokens_per_forward_sum") == 56
    assert delta("target", "specops_forward_seconds_count") == 2
    assert delta("draft", "specops_batch_rows_sum") == 8
    assert delta("draft", "specops_forward_seconds_count") == 1
    with pytest.raises(ValueError, match="kind"):
        observe_forward("verify", rows=1, tokens=1, seconds=0.01)


# ---------------------------------------------------------------------------- speculation

def test_observe_speculation_counts_totals_and_each_position(drafter):
    # Two steps of a 3-deep chain over a batch: 4 drafts, 12 positions drafted, 6 accepted.
    observe_speculation(drafter, [2, 2, 2], [2, 1, 0], drafts=2)
    observe_speculation(drafter, [2, 2, 2], [2, 1, 0], drafts=2)

    assert sample("specops_spec_decode_num_drafts_total", drafter=drafter) == 4
    assert sample("specops_spec_decode_num_draft_tokens_total", drafter=drafter) == 12
    assert sample("specops_spec_decode_num_accepted_tokens_total", drafter=drafter) == 6
    drafted = {p: sample("specops_spec_decode_num_drafted_tokens_per_pos_total", drafter=drafter, position=p)
               for p in ("1", "2", "3")}
    accepted = {p: sample("specops_spec_decode_num_accepted_tokens_per_pos_total", drafter=drafter, position=p)
                for p in ("1", "2", "3")}
    assert drafted == {"1": 4, "2": 4, "3": 4}
    assert accepted == {"1": 4, "2": 2, "3": 0}
    # A position that was always rejected has a series at 0, so its acceptance reads 0, not nothing.
    assert "3" in label_values("specops_spec_decode_num_accepted_tokens_per_pos_total", "position",
                               drafter=drafter)
    assert "0" not in label_values("specops_spec_decode_num_drafted_tokens_per_pos_total", "position",
                                   drafter=drafter)


def test_observe_schedule_counts_steps_by_length_and_the_estimates_against_the_accepted(drafter):
    observe_schedule(drafter, [3, 0, 2, 1], expected=4.5, accepted=3)
    observe_schedule(drafter, [1], expected=0.0, accepted=0)
    steps = {length: sample("specops_scheduled_verify_steps_total", drafter=drafter, length=length)
             for length in ("0", "2", "3")}
    assert steps == {"0": 4, "2": 2, "3": 1}
    assert "1" not in label_values("specops_scheduled_verify_steps_total", "length", drafter=drafter)
    assert sample("specops_scheduled_expected_tokens_total", drafter=drafter) == 4.5
    assert sample("specops_scheduled_accepted_tokens_total", drafter=drafter) == 3


def test_the_step_cost_table_is_exported_from_the_engines_cost_models():
    from inference.engine.batch.policy import ForwardCostModel

    target, empty = ForwardCostModel(), ForwardCostModel()
    for rows, tokens, seconds in ((1, 1, 0.010), (4, 1, 0.016), (4, 5, 0.040), (1, 5, 0.016)):
        target.observe(rows, tokens, seconds)
    observe_step_costs({"target": target, "draft": empty})
    one = sample("specops_step_cost_estimate_seconds", model="target", rows="1", tokens="1")
    wide = sample("specops_step_cost_estimate_seconds", model="target", rows="16", tokens="8")
    assert one == pytest.approx(target.estimate(1, 1)) and wide == pytest.approx(target.estimate(16, 8))
    assert wide > one
    assert "draft" not in label_values("specops_step_cost_estimate_seconds", "model")  # nothing measured


def test_positions_past_the_cap_count_in_the_totals_only(drafter):
    depth = MAX_POSITION + 4
    observe_speculation(drafter, [1] * depth, [1] * depth, drafts=1)

    assert sample("specops_spec_decode_num_draft_tokens_total", drafter=drafter) == depth
    assert sample("specops_spec_decode_num_accepted_tokens_total", drafter=drafter) == depth
    positions = label_values("specops_spec_decode_num_drafted_tokens_per_pos_total", "position", drafter=drafter)
    assert positions == {str(p) for p in range(1, MAX_POSITION + 1)}


def test_observe_speculation_refuses_more_accepted_positions_than_drafted(drafter):
    with pytest.raises(ValueError, match="accepted_per_position"):
        observe_speculation(drafter, [1], [1, 1], drafts=1)


def test_a_finished_generations_stats_feed_the_per_position_counters(drafter):
    """GenerationStats' own lists are what observe_speculation takes."""
    from inference.engine.stats import GenerationStats

    stats = GenerationStats()
    stats.record_step(drafted=4, depth=4, accepted=4)
    stats.record_step(drafted=4, depth=4, accepted=1)
    stats.record_step(drafted=2, depth=2, accepted=0)
    observe_speculation(drafter, stats.drafted_per_position, stats.accepted_per_position, drafts=stats.steps)

    per_pos = [sample("specops_spec_decode_num_accepted_tokens_per_pos_total", drafter=drafter, position=str(p))
               / sample("specops_spec_decode_num_drafted_tokens_per_pos_total", drafter=drafter, position=str(p))
               for p in range(1, 5)]
    assert per_pos == pytest.approx(stats.acceptance_per_position)
    assert sample("specops_spec_decode_num_drafts_total", drafter=drafter) == 3


def test_observe_policy_decision_counts_depths_and_sets_the_running_rows():
    before = {d: sample("specops_spec_decode_policy_depth_total", depth=d) for d in ("0", "4", str(MAX_POSITION))}
    observe_policy_decision(depth=4, rows=3)
    observe_policy_decision(depth=0, rows=12)
    observe_policy_decision(depth=0, rows=12)
    observe_policy_decision(depth=99, rows=5)

    assert sample("specops_spec_decode_policy_depth_total", depth="4") - before["4"] == 1
    assert sample("specops_spec_decode_policy_depth_total", depth="0") - before["0"] == 2
    assert sample("specops_spec_decode_policy_depth_total", depth=str(MAX_POSITION)) - before[str(MAX_POSITION)] == 1
    assert sample("specops_batch_running_rows") == 5


def test_observe_writer_backlog_sets_the_waiting_items_and_the_bound():
    observe_writer_backlog(waiting=3, capacity=256)
    assert sample("specops_batch_writer_waiting_items") == 3
    assert sample("specops_batch_writer_capacity_items") == 256
    observe_writer_backlog(waiting=0, capacity=256)
    assert sample("specops_batch_writer_waiting_items") == 0


def test_the_running_rows_gauge_declares_a_multiprocess_mode():
    assert metrics.BATCH_RUNNING_ROWS._multiprocess_mode in ("livesum", "mostrecent")


# ---------------------------------------------------------------------------- the sequential path

def test_observe_generation_still_records_a_finished_generation(drafter):
    observe_generation(drafter, "succeeded", 1.2, {"new_tokens": 16, "drafted": 10, "accepted": 8})
    observe_generation(drafter, "failed", 0.3, None)

    assert sample("specops_generation_seconds_count", drafter=drafter, status="succeeded") == 1
    assert sample("specops_generation_seconds_count", drafter=drafter, status="failed") == 1
    assert sample("specops_generation_tokens_total", drafter=drafter) == 16
    assert sample("specops_speculative_accepted_tokens_total", drafter=drafter) == 8
