"""Stop conditions: max_new_tokens, EOS, stop strings, the context limit, too-long prompts."""

from __future__ import annotations

import pytest

from inference.engine import (
    ConfigError,
    DraftConfig,
    GenerationConfig,
    PromptTooLongError,
    SpeculativeDecoder,
    build_drafter,
)
from inference.engine.decode.stopping import StopCondition
from inference.engine.decode.target_only import generate_plain

from .conftest import CONTEXT, noisy_copy, target_model

PROMPT = [7, 3, 9, 14, 2]


def _decode(tokens: list[int]) -> str:
    return "".join(f"<{token}>" for token in tokens)


def _decoder(arch: str = "llama", kind: str = "draft_model", **config) -> SpeculativeDecoder:
    target = target_model(arch)
    drafter = build_drafter(kind, target=target, draft=noisy_copy(arch),
                            config=DraftConfig(**config))
    return SpeculativeDecoder(target, drafter, decode=_decode)


def test_clip_cuts_at_the_first_of_eos_and_length():
    stop = StopCondition(GenerationConfig(max_new_tokens=5, eos_token_id=(4, 9)), 5, None)
    assert stop.clip([1, 2], [3, 9, 5]) == ([3, 9], "eos")
    assert stop.clip([1, 2], [3, 5, 6, 7]) == ([3, 5, 6], "length")
    assert stop.clip([1, 2, 3, 5], [4, 6]) == ([4], "eos")
    assert stop.clip([], [3]) == ([3], None)


def test_stop_string_spanning_tokens_cuts_after_the_completing_token():
    stop = StopCondition(GenerationConfig(stop_strings=("3><4",)), 50, _decode)
    assert stop.clip([1, 3], [4, 5, 6]) == ([4], "stop")
    assert stop.clip([1], [3, 5]) == ([3, 5], None)


def test_stop_strings_need_a_decoder():
    with pytest.raises(ConfigError, match="stop_strings"):
        StopCondition(GenerationConfig(stop_strings=("x",)), 5, None)


@pytest.mark.parametrize("kind", ["draft_model", "tree", "ngram"])
def test_stop_string_ends_generation_like_the_plain_loop(kind):
    free_run = generate_plain(target_model("llama"), PROMPT,
                              GenerationConfig(max_new_tokens=30)).token_ids
    stop_text = _decode(free_run[11:13])  # completed by the 13th new token
    config = GenerationConfig(max_new_tokens=30, stop_strings=(stop_text,))
    expected = generate_plain(target_model("llama"), PROMPT, config, decode=_decode)
    result = _decoder(kind=kind, length=6, tree_depth=6).generate(PROMPT, config)
    assert result.token_ids == expected.token_ids
    assert result.finish_reason == expected.finish_reason == "stop"
    assert stop_text in _decode(result.token_ids)
    assert stop_text not in _decode(result.token_ids[:-1])


def test_prompt_too_long_is_refused_before_any_forward(monkeypatch):
    decoder = _decoder()
    calls = []
    monkeypatch.setattr(decoder.target, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(PromptTooLongError, match=f"at most {CONTEXT - 1} tokens"):
        decoder.stream([1] * CONTEXT, GenerationConfig())
    with pytest.raises(PromptTooLongError):
        generate_plain(decoder.target, [1] * CONTEXT, GenerationConfig())
    assert calls == []


def test_max_new_tokens_is_clamped_to_the_context():
    decoder = _decoder(length=8)
    prompt = [2 + i % 90 for i in range(CONTEXT - 10)]
    result = decoder.generate(prompt, GenerationConfig(max_new_tokens=50))
    expected = generate_plain(decoder.target, prompt, GenerationConfig(max_new_tokens=50))
    assert len(result.token_ids) == 10
    assert result.token_ids == expected.token_ids
    assert result.finish_reason == "length"
    one_left = decoder.generate(prompt + [5] * 9, GenerationConfig(max_new_tokens=50))
    assert len(one_left.token_ids) == 1


def test_empty_prompt_or_unknown_token_is_a_config_error():
    with pytest.raises(ConfigError, match="prompt_ids"):
        _decoder().generate([], GenerationConfig())
    with pytest.raises(ConfigError, match=r"prompt_ids: every token id must be in \[0, 96\)"):
        _decoder().generate([3, 96], GenerationConfig())


@pytest.mark.parametrize(("field", "value"), [
    ("max_new_tokens", 0), ("temperature", -1.0), ("top_k", -1), ("top_p", 0.0),
    ("stop_strings", ("",)), ("eos_token_id", ("a",)),
])
def test_generation_config_names_the_broken_field(field, value):
    with pytest.raises(ConfigError, match=field):
        GenerationConfig(**{field: value})


@pytest.mark.parametrize(("field", "value"), [
    ("length", 0), ("min_length", 0), ("confidence_threshold", 1.0), ("tree_width", 0),
    ("node_budget", 0), ("ngram_min_size", 5),
])
def test_draft_config_names_the_broken_field(field, value):
    with pytest.raises(ConfigError, match=field):
        DraftConfig(**{field: value})
