"""Loading models from local directories: the one path every model goes through."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, PretrainedConfig

from inference.demo.corpus import sample_texts
from inference.demo.tokenizer_builder import train_tokenizer
from inference.engine import (
    GenerationConfig,
    SpeculativeDecoder,
    build_drafter,
    generate_plain,
    resolve_eos,
)
from inference.engine.errors import EngineError
from inference.engine.lm.loading import (
    LoadedModel,
    ModelLoadError,
    check_pair_directories,
    describe_model,
    load_causal_lm,
    load_model_pair,
    model_context_length,
)
from inference.demo.tiny_models import (
    TINY_DRAFT,
    build_foreign_draft,
    build_tiny_pair,
    causal_lm_config,
    random_causal_lm,
    save_model_dir,
)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("models"), arch="qwen2", seed=0,
                           cache_dir=tmp_path_factory.mktemp("specops-cache"))


def test_load_returns_an_eval_model_its_tokenizer_and_context(tiny_pair):
    target_dir, _ = tiny_pair
    loaded = load_causal_lm(str(target_dir))
    assert isinstance(loaded, LoadedModel)
    assert loaded.path == target_dir
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.dtype == torch.float32
    assert loaded.device == torch.device("cpu")
    assert loaded.context_length == loaded.model.config.max_position_embeddings
    assert loaded.model.config._attn_implementation == "sdpa"
    assert loaded.tokenizer.eos_token_id is not None


def test_saved_weights_load_back_unchanged(tmp_path):
    tokenizer = train_tokenizer(sample_texts(20_000), vocab_size=300)
    model = random_causal_lm(causal_lm_config("gpt2", TINY_DRAFT, tokenizer), seed=7)
    save_model_dir(model, tokenizer, tmp_path / "m", marker={"kind": "test"})
    loaded = load_causal_lm(tmp_path / "m")
    ids = torch.tensor([[1, 5, 99, 200, 7]])
    with torch.inference_mode():
        assert torch.allclose(model(ids).logits, loaded.model(ids).logits, atol=1e-6)


def test_explicit_dtype_is_honoured(tiny_pair):
    assert load_causal_lm(tiny_pair[1], dtype=torch.bfloat16).model.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["does-not-exist/anywhere", "/no/such/dir", "./relative/dir"])
def test_missing_model_is_a_clear_error_naming_the_path(name):
    with pytest.raises(ModelLoadError, match=name.lstrip("./")) as raised:
        load_causal_lm(name)
    assert isinstance(raised.value, EngineError)


def test_a_file_or_a_directory_without_a_model_is_refused(tmp_path, tiny_pair):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="is a file"):
        load_causal_lm(tmp_path / "weights.bin")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_causal_lm(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_pair[0], broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=str(broken)):
        load_causal_lm(broken)
    untokenized = tmp_path / "untokenized"
    shutil.copytree(tiny_pair[0], untokenized)
    (untokenized / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="untokenized"):
        load_causal_lm(untokenized)


def test_pair_with_different_tokenizers_is_refused(tmp_path, tiny_pair):
    build_foreign_draft(tmp_path / "foreign-draft")
    with pytest.raises(ModelLoadError, match="does not share the tokenizer"):
        load_model_pair(tiny_pair[0], tmp_path / "foreign-draft")
    target, draft = load_model_pair(*tiny_pair)
    assert describe_model(draft)["parameters"] < describe_model(target)["parameters"]


def _names_both(error: pytest.ExceptionInfo, target_dir, draft_dir) -> bool:
    message = str(error.value)
    return str(target_dir) in message and str(draft_dir) in message and "\n" not in message


def test_a_drafter_built_from_loaded_models_checks_the_pair(tmp_path, tiny_pair):
    """The worker builds drafters from loaded models: a foreign draft is refused there too."""
    foreign_dir = build_foreign_draft(tmp_path / "foreign-draft")
    target, foreign = load_causal_lm(tiny_pair[0]), load_causal_lm(foreign_dir)
    for kind in ("draft_model", "tree"):
        with pytest.raises(ModelLoadError, match="does not share the tokenizer") as raised:
            build_drafter(kind, target=target, draft=foreign)
        assert _names_both(raised, tiny_pair[0], foreign_dir)
    assert build_drafter("ngram", target=target, draft=foreign).name == "ngram"  # no draft used
    with pytest.raises(ModelLoadError) as raised:
        check_pair_directories(tiny_pair[0], foreign_dir)  # registration: tokenizers only
    assert _names_both(raised, tiny_pair[0], foreign_dir)
    check_pair_directories(*tiny_pair)


def test_a_loaded_pair_goes_straight_into_the_decoder(tiny_pair):
    """No `.model` unwrapping: the decoder takes LoadedModels, decodes with their tokenizer and
    stops at the target's own EOS unless told otherwise."""
    target, draft = load_model_pair(*tiny_pair)
    decoder = SpeculativeDecoder(target, build_drafter("draft_model", target, draft))
    assert decoder.target is target.model and decoder.decode == target.tokenizer.decode
    prompt = target.tokenizer("def main():\n    return 0\n")["input_ids"]
    free = generate_plain(target, prompt, GenerationConfig(max_new_tokens=24, eos_token_id=()))
    stop_text = target.tokenizer.decode(free.token_ids[:3])[-2:]
    stopped = decoder.generate(prompt, GenerationConfig(max_new_tokens=24, stop_strings=(stop_text,)))
    assert stopped.finish_reason == "stop" and stop_text in target.tokenizer.decode(stopped.token_ids)
    eos = target.model.generation_config.eos_token_id
    assert eos == target.tokenizer.eos_token_id
    assert resolve_eos(GenerationConfig(), target).eos_token_ids == {eos}
    assert resolve_eos(GenerationConfig(eos_token_id=()), target).eos_token_ids == frozenset()
    assert resolve_eos(GenerationConfig(eos_token_id=7), target.model).eos_token_ids == {7}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (GPT2Config(n_positions=321), 321),
        (LlamaConfig(max_position_embeddings=4096), 4096),
    ],
)
def test_context_length_reads_each_family_s_attribute(config, expected):
    assert model_context_length(config) == expected


def test_context_length_unknown_is_an_error():
    with pytest.raises(ModelLoadError, match="context length"):
        model_context_length(PretrainedConfig())
