"""Structured output in the single-sequence decoder: lossless greedy under a grammar, valid JSON.

Greedy speculative decoding under a constraint must emit exactly what the target alone emits
with its logits masked to the grammar (generate_plain, and Hugging Face `generate` with the same
mask as a logits processor), for every drafter; every output parses and validates. The tiny
random models have never seen JSON, so validity comes from the grammar alone.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from inference.engine import DraftConfig, GenerationConfig, SpeculativeDecoder, build_drafter
from inference.engine.constraints import (
    ConstraintError,
    OutputConstraint,
    check_constraint,
    constraint_from_response_format,
    new_matcher,
)
from inference.engine.decode.decoder import MAX_FORCED_DRAFT
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.target_only import generate_plain

from .constraint_models import VOCAB, json_tokenizer, models, prompt_ids

SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]}},
        "required": ["name", "age", "kind"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "owner": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9},
            "ok": {"type": "boolean"}}, "required": ["id", "ok"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3}},
        "required": ["owner", "tags"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
                            {"type": "string", "enum": ["none", "many"]},
                            {"type": "null"}]},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}},
        "required": ["value", "ratio"], "additionalProperties": False},
}

DRAFTERS = [("draft_model", 1), ("draft_model", 2), ("tree", 2), ("ngram", None), ("suffix", None),
            ("none", None)]


def _config(schema: dict, **overrides) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=160, eos_token_id=json_tokenizer().eos_token_id,
                            constraint=OutputConstraint.json_schema(schema), **overrides)


def _drafter(kind: str, which: int | None):
    target, draft, noisy = models()
    config = DraftConfig(tree_width=2, tree_depth=3, node_budget=6)
    return build_drafter(kind, target=target, draft={1: draft, 2: noisy}.get(which), config=config)


def _valid(tokens: list[int], schema: dict) -> dict:
    reply = json.loads(json_tokenizer().decode(tokens))
    jsonschema.validate(reply, schema)
    return reply


@pytest.mark.parametrize("schema_name", sorted(SCHEMAS))
@pytest.mark.parametrize(("kind", "which"), DRAFTERS)
def test_greedy_speculative_output_equals_the_constrained_target(schema_name, kind, which):
    schema, target = SCHEMAS[schema_name], models()[0]
    reference = generate_plain(target, prompt_ids(), _config(schema), tokenizer=json_tokenizer())
    decoder = SpeculativeDecoder(target, _drafter(kind, which), tokenizer=json_tokenizer())
    result = decoder.generate(prompt_ids(), _config(schema))
    assert result.token_ids == reference.token_ids
    assert result.finish_reason == reference.finish_reason == "stop"
    _valid(result.token_ids, schema)


class GrammarProcessor(LogitsProcessor):
    """The grammar as a Hugging Face logits processor: the reference lossless must equal."""

    def __init__(self, constraint: OutputConstraint, prompt_length: int) -> None:
        self.matcher = new_matcher(json_tokenizer(), VOCAB, constraint,
                                   (json_tokenizer().eos_token_id,))
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.prompt_length:
            self.matcher.advance([int(input_ids[0, -1])])
        return scores.masked_fill(~self.matcher.allowed()[None], float("-inf"))


@pytest.mark.parametrize("schema_name", sorted(SCHEMAS))
def test_greedy_equals_transformers_generate_with_the_grammar_as_a_logits_processor(schema_name):
    schema, (target, _, noisy) = SCHEMAS[schema_name], models()
    config = _config(schema)
    processor = GrammarProcessor(config.constraint, len(prompt_ids()))
    generated = target.generate(torch.tensor([prompt_ids()]), do_sample=False, max_new_tokens=160,
                                logits_processor=LogitsProcessorList([processor]),
                                eos_token_id=json_tokenizer().eos_token_id, pad_token_id=0)
    expected = generated[0, len(prompt_ids()):].tolist()
    decoder = SpeculativeDecoder(target, build_drafter("draft_model", target=target, draft=noisy),
                                 tokenizer=json_tokenizer())
    tokens = decoder.generate(prompt_ids(), config).token_ids
    # generate reads the grammar's only continuation after the end, EOS, one step later
    assert expected == tokens + [json_tokenizer().eos_token_id]


def test_json_object_mode_emits_an_object():
    target, draft, _ = models()
    config = GenerationConfig(max_new_tokens=200, eos_token_id=json_tokenizer().eos_token_id,
                              constraint=OutputConstraint("json_object"))
    decoder = SpeculativeDecoder(target, build_drafter("draft_model", target=target, draft=draft),
                                 tokenizer=json_tokenizer())
    result = decoder.generate(prompt_ids(), config)
    reference = generate_plain(target, prompt_ids(), config, tokenizer=json_tokenizer())
    assert result.token_ids == reference.token_ids
    text = json_tokenizer().decode(result.token_ids)
    assert text.startswith("{")
    if result.finish_reason == "stop":  # the grammar completed: the whole reply is an object
        assert isinstance(json.loads(text), dict)


def test_forced_tokens_are_drafted_for_free():
    """With no drafter at all, a schema of long fixed keys still takes far fewer steps than tokens,
    and every forced token is accepted."""
    schema = {"type": "object", "properties": {
        "identification_number": {"enum": [7]}, "classification": {"enum": ["primary"]}},
        "required": ["identification_number", "classification"], "additionalProperties": False}
    target = models()[0]
    decoder = SpeculativeDecoder(target, _drafter("none", None), tokenizer=json_tokenizer())
    result = decoder.generate(prompt_ids(), _config(schema))
    assert _valid(result.token_ids, schema) == {"identification_number": 7, "classification": "primary"}
    assert decoder.stats.drafted > 0 and decoder.stats.accepted == decoder.stats.drafted
    # each step: up to MAX_FORCED_DRAFT forced drafts and the target's own token
    assert decoder.stats.steps == -(-len(result.token_ids) // (MAX_FORCED_DRAFT + 1))


def test_masks_along_a_tree_leave_the_matcher_where_it_was_and_mark_forbidden_drafts():
    tokenizer = json_tokenizer()
    matcher = new_matcher(tokenizer, VOCAB, OutputConstraint.json_schema(SCHEMAS["flat"]),
                          (tokenizer.eos_token_id,))
    before = matcher.allowed()
    brace, letter = int(before.nonzero()[0]), tokenizer.convert_tokens_to_ids("x")
    assert tokenizer.decode([brace]).startswith("{")
    tree = DraftTree([brace, letter, letter], [-1, -1, 0], [0.0] * 3)
    masks, valid = matcher.masks_along(tree)
    assert valid == [True, False, False]
    assert masks.shape == (4, VOCAB) and bool(masks[0, brace]) and not bool(masks[0, letter])
    assert torch.equal(masks[2], masks[0])  # a forbidden node's row: its parent's, never empty
    assert torch.equal(matcher.allowed(), before)
    assert not masks[:, len(tokenizer):].any()  # padded ids are never allowed


def test_a_schema_the_engine_cannot_compile_is_refused_before_any_forward():
    bad = OutputConstraint.json_schema({"type": "nonsense"})
    with pytest.raises(ConstraintError, match="constraint.schema"):
        check_constraint(bad)
    target, draft, _ = models()
    decoder = SpeculativeDecoder(target, build_drafter("draft_model", target=target, draft=draft),
                                 tokenizer=json_tokenizer())
    with pytest.raises(ConstraintError, match="constraint.schema"):
        decoder.stream(prompt_ids(), GenerationConfig(constraint=bad))
    with pytest.raises(ConstraintError, match="constraint.schema"):
        OutputConstraint("json_schema", "{not json")
    with pytest.raises(ConstraintError, match="constraint.kind"):
        OutputConstraint("yaml")


def test_a_constraint_without_a_tokenizer_is_a_config_error():
    target = models()[0]
    with pytest.raises(ConstraintError, match="tokenizer"):
        generate_plain(target, prompt_ids(), _config(SCHEMAS["flat"]))


@pytest.mark.parametrize(("value", "path"), [
    ({"type": "yaml"}, "response_format.type"),
    ("json", "response_format"),
    ({"type": "json_object", "schema": {}}, "response_format.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}, "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "shema": {}}}, "response_format.json_schema.shema"),
])
def test_a_response_format_is_refused_naming_the_field(value, path):
    with pytest.raises(ConstraintError) as refused:
        constraint_from_response_format(value)
    assert str(refused.value).startswith(f"{path}: ")


def test_a_response_format_reads_as_the_constraint_it_asks_for():
    assert constraint_from_response_format(None) is None
    assert constraint_from_response_format({"type": "text"}) is None
    assert constraint_from_response_format({"type": "json_object"}) == OutputConstraint("json_object")
    schema = SCHEMAS["nested"]
    assert constraint_from_response_format(
        {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}},
    ) == OutputConstraint.json_schema(schema)
