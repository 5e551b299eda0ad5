"""How deep rows draft under confidence scheduling: as deep as a position pays for its drafting.

A draft-model chain's every extra position costs a shared draft forward; the engine runs one
only for the chains whose next position is worth it (`ConfidenceScheduler.extend_chains` (scheduling.py), and
before the first forward `_worth_a_draft_forward`). With a draft as dear as the target nothing
is worth a draft forward (only the periodic exploration drafts); with a cheap draft that agrees
with its target, chains run deep. The costs here are formulas, not timings, so the outcome does
not depend on the machine.
"""

from __future__ import annotations

from inference.engine import DraftConfig, GenerationConfig
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.batch.policy import SpeculationPolicy
from inference.engine.decode.target_only import generate_plain

from .conftest import noisy_copy, target_model
from .test_policy_cold_start import agreeing_pair


class _FormulaCosts:
    """A forward cost model of fixed + per-token seconds that ignores measured forwards."""

    def __init__(self, fixed: float, per_token: float) -> None:
        self.fixed, self.per_token = fixed, per_token
        self.observations = 1

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        pass

    def estimate(self, rows: int, tokens: float) -> float:
        return self.fixed + self.per_token * rows * tokens if rows > 0 and tokens > 0 else 0.0


def _policy(draft_fixed: float, draft_per_token: float) -> SpeculationPolicy:
    policy = SpeculationPolicy(max_depth=6)
    policy.target_costs = _FormulaCosts(1.0, 0.01)
    policy.draft_costs = _FormulaCosts(draft_fixed, draft_per_token)
    policy.step_overheads = _FormulaCosts(0.0, 0.0)
    policy.step_overheads.observations = 0
    return policy


def _run(target, draft, policy: SpeculationPolicy, rows: int = 4):
    engine = BatchedSpeculativeEngine(target, draft, decode=lambda ids: "", max_rows=rows, policy=policy,
                                      prefill="separate")
    config = GenerationConfig(max_new_tokens=40, eos_token_id=())
    prompts = [[5, 9, 2, 7, 3 + index] for index in range(rows)]
    requests = [BatchRequest(index, prompt, config, "draft_model", DraftConfig()) for index, prompt in enumerate(prompts)]
    results = engine.run(requests)
    for index, prompt in enumerate(prompts):
        assert results[index].token_ids == generate_plain(target, prompt, config).token_ids
    return engine, results


def test_a_draft_as_dear_as_its_target_is_run_only_to_explore():
    target = target_model("llama")
    engine, results = _run(target, noisy_copy("llama"), _policy(1.0, 0.01))
    decode_steps = sum(result.stats.scheduled_steps for result in results.values()) // len(results)
    draft_forwards = [entry for entry in engine.forward_log if entry[0] == "draft"]
    # exploration after 4, 8, 16 undrafted steps: a handful of steps draft, one position each
    # (one draft forward, which also catches the rows' draft caches up)
    assert decode_steps >= 30
    assert 1 <= len(draft_forwards) <= 4, draft_forwards
    assert all(result.stats.verified_lengths[0] >= decode_steps - 4 for result in results.values())


def test_a_cheap_draft_that_agrees_with_its_target_drafts_deep():
    target, draft = agreeing_pair()
    engine, results = _run(target, draft, _policy(0.02, 0.0))
    for result in results.values():
        lengths = result.stats.verified_lengths
        deep = sum(lengths[3:])
        assert deep >= 0.7 * result.stats.scheduled_steps, lengths
        assert result.stats.accepted == result.stats.drafted  # the draft is the target
        # the calibration learned that: realised over expected climbs towards 1 from below
        # (the estimates started at the prior, 0.7 a position)
        assert result.stats.survival_calibration >= 1.0
