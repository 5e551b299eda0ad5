"""Structured output in the batched engine: constrained and free rows in one batch, each row's
greedy output identical to the target alone under the same grammar, resumed rows included."""

from __future__ import annotations

import pytest

from inference.engine import GenerationConfig
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.decode.target_only import generate_plain
from inference.engine.lm.loading import LoadedModel

from .constraint_models import CONTEXT, json_tokenizer, models, prompt_ids
from .test_constraints import SCHEMAS, _config, _valid

KINDS = ("draft_model", "tree", "ngram", "none")


def _engine(prefill: str) -> BatchedSpeculativeEngine:
    target, _, noisy = models()
    return BatchedSpeculativeEngine(LoadedModel(target, json_tokenizer(), CONTEXT, None),
                                    LoadedModel(noisy, json_tokenizer(), CONTEXT, None), prefill=prefill)


def _free_config() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=30, eos_token_id=json_tokenizer().eos_token_id)


@pytest.mark.parametrize("prefill", ["separate", "shared"])
def test_constrained_and_free_rows_in_one_batch_equal_their_target_alone(prefill):
    target = models()[0]
    requests = [BatchRequest((name, kind), prompt_ids(), _config(schema), drafter=kind)
                for name, schema in SCHEMAS.items() for kind in KINDS]
    requests.append(BatchRequest("free", prompt_ids(), _free_config(), drafter="draft_model"))
    results = _engine(prefill).run(requests, arrivals={("nested", "tree"): 3, "free": 2})
    for request in requests:
        reference = generate_plain(target, prompt_ids(), request.config, tokenizer=json_tokenizer())
        result = results[request.request_id]
        assert result.token_ids == reference.token_ids, request.request_id
        assert result.finish_reason == reference.finish_reason
        if request.request_id != "free":
            assert result.finish_reason == "stop"
            _valid(result.token_ids, SCHEMAS[request.request_id[0]])


def test_forced_tokens_verify_in_one_step_without_any_drafter():
    schema = {"type": "object", "properties": {"classification_of_the_item": {"enum": ["primary"]}},
              "required": ["classification_of_the_item"], "additionalProperties": False}
    result = _engine("shared").run([BatchRequest("r", prompt_ids(), _config(schema), drafter="none")])["r"]
    assert _valid(result.token_ids, schema) == {"classification_of_the_item": "primary"}
    assert result.stats.accepted == result.stats.drafted > 0
    assert result.stats.steps < len(result.token_ids) / 4


@pytest.mark.parametrize("cut", [1, 5, 12])
def test_a_resumed_row_rebuilds_its_grammar_from_the_committed_tokens(cut):
    target, schema = models()[0], SCHEMAS["nested"]
    reference = generate_plain(target, prompt_ids(), _config(schema), tokenizer=json_tokenizer()).token_ids
    resumed = _engine("separate").run([BatchRequest("r", prompt_ids(), _config(schema), drafter="draft_model",
                                                    resume_ids=tuple(reference[:cut]))])["r"]
    assert reference[:cut] + resumed.token_ids == reference


@pytest.mark.parametrize("kind", KINDS)
def test_a_seeded_sampled_constrained_row_gives_the_tokens_it_gives_alone(kind):
    from inference.engine import DraftConfig, SpeculativeDecoder, build_drafter

    target, _, noisy = models()
    config = _config(SCHEMAS["nested"], temperature=0.9, seed=11)
    draft_config = DraftConfig(length=3, tree_width=2, tree_depth=3, node_budget=6)
    alone = SpeculativeDecoder(target, build_drafter(kind, target=target, draft=noisy, config=draft_config),
                               tokenizer=json_tokenizer()).generate(prompt_ids(), config)
    companions = [BatchRequest(f"greedy{index}", prompt_ids(), _config(schema), drafter="draft_model")
                  for index, schema in enumerate(SCHEMAS.values())]
    batched = _engine("separate").run(
        companions + [BatchRequest("seeded", prompt_ids(), config, drafter=kind, draft_config=draft_config)],
        arrivals={"greedy1": 2})["seeded"]
    assert batched.token_ids == alone.token_ids
    _valid(batched.token_ids, SCHEMAS["nested"])


class _BrokenMatcher:
    """A grammar state that fails, as one past a parser limit would."""

    def forced_tokens(self, limit):
        return []

    def masks_along(self, tree):
        raise RuntimeError("parser limit reached")


def test_a_row_whose_grammar_fails_ends_alone_and_its_companions_go_on():
    engine, target = _engine("shared"), models()[0]
    engine.submit(BatchRequest("broken", prompt_ids(), _config(SCHEMAS["flat"]), drafter="ngram"))
    engine.submit(BatchRequest("free", prompt_ids(), _free_config(), drafter="draft_model"))
    engine.waiting[0].matcher = _BrokenMatcher()
    tokens, finished = {"broken": [], "free": []}, {}
    while engine.has_work():
        for event in engine.step():
            tokens[event.request_id] += event.step.token_ids
            if event.finished:
                finished[event.request_id] = event.step.finish_reason
    assert finished["broken"] == "error" and tokens["broken"] == []
    assert tokens["free"] == generate_plain(target, prompt_ids(), _free_config()).token_ids
