"""Tiny random pairs and the locally trained tokenizer: real files, real Auto* loading."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from inference.demo import corpus
from inference.demo.tokenizer_builder import (
    EOS_TOKEN,
    PAD_TOKEN,
    stdlib_tokenizer,
    train_tokenizer,
)
from inference.engine.lm.loading import load_causal_lm, load_model_pair
from inference.demo.tiny_models import ARCHITECTURES, MARKER_FILE, build_tiny_pair

ODD_TEXT = "def f(x):\n\treturn x  # naïve, 日本語, emoji 🐍\r\n    \n\x00end"


@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory):
    """A tokenizer cache of these tests' own, out of the user's home directory."""
    return tmp_path_factory.mktemp("specops-cache")


@pytest.fixture(scope="module")
def small_tokenizer():
    return train_tokenizer(corpus.sample_texts(60_000), vocab_size=400)


def test_tokenizer_round_trips_any_text_and_sets_special_tokens(small_tokenizer):
    ids = small_tokenizer(ODD_TEXT)["input_ids"]
    assert small_tokenizer.decode(ids) == ODD_TEXT
    assert small_tokenizer.eos_token == EOS_TOKEN and small_tokenizer.bos_token == EOS_TOKEN
    assert small_tokenizer.pad_token == PAD_TOKEN
    assert small_tokenizer.pad_token_id != small_tokenizer.eos_token_id
    assert len(small_tokenizer) == 400
    # Trained merges make code shorter than its bytes.
    code = "    def __init__(self, *args, **kwargs):\n        return None\n"
    assert len(small_tokenizer(code)["input_ids"]) < len(code.encode()) / 2


def test_tokenizer_saves_and_loads_back_through_auto_tokenizer(small_tokenizer, tmp_path):
    small_tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.get_vocab() == small_tokenizer.get_vocab()
    assert loaded(ODD_TEXT)["input_ids"] == small_tokenizer(ODD_TEXT)["input_ids"]
    assert (loaded.eos_token_id, loaded.pad_token_id) == (
        small_tokenizer.eos_token_id,
        small_tokenizer.pad_token_id,
    )


def test_tokenizer_training_is_deterministic_and_data_dependent():
    texts = corpus.sample_texts(30_000)
    first = train_tokenizer(texts, vocab_size=350).get_vocab()
    assert train_tokenizer(texts, vocab_size=350).get_vocab() == first
    assert train_tokenizer(["zzz qqq " * 500], vocab_size=350).get_vocab() != first


def test_tokenizer_refuses_a_vocabulary_too_small_for_the_bytes():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["x"], vocab_size=100)


def test_stdlib_tokenizer_is_cached_on_disk(tokenizer_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECOPS_CACHE_DIR", str(tmp_path))  # the caller names the cache; no env
    first = stdlib_tokenizer(vocab_size=300, sample_chars=20_000, cache_dir=tokenizer_cache)
    saved = list((tokenizer_cache / "tokenizers").glob("stdlib-bpe-300-*/tokenizer.json"))
    assert len(saved) == 1
    assert not any(tmp_path.iterdir())
    mtime = saved[0].stat().st_mtime_ns
    second = stdlib_tokenizer(vocab_size=300, sample_chars=20_000, cache_dir=tokenizer_cache)
    assert second.get_vocab() == first.get_vocab()
    assert saved[0].stat().st_mtime_ns == mtime


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_pair_loads_through_auto_classes_and_shares_a_tokenizer(tmp_path, arch,
                                                                     tokenizer_cache):
    target_dir, draft_dir = build_tiny_pair(tmp_path, arch=arch, seed=0, cache_dir=tokenizer_cache)
    target, draft = load_model_pair(target_dir, draft_dir)
    assert target.model.config.model_type == arch == draft.model.config.model_type
    assert target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    assert target.vocab_size == draft.vocab_size == len(target.tokenizer)
    target_params = sum(p.numel() for p in target.model.parameters())
    draft_params = sum(p.numel() for p in draft.model.parameters())
    assert draft_params < target_params / 2
    assert target.context_length == 1024
    ids = target.tokenizer("import os\n", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = target.model(ids).logits
    assert logits.shape == (1, ids.shape[1], target.vocab_size)
    assert torch.isfinite(logits).all()


def test_tiny_pair_weights_are_fixed_by_the_seed(tmp_path):
    first = build_tiny_pair(tmp_path / "a", arch="llama", seed=3)
    again = build_tiny_pair(tmp_path / "b", arch="llama", seed=3)
    other = build_tiny_pair(tmp_path / "c", arch="llama", seed=4)

    def weights(directory):
        return load_causal_lm(directory).model.state_dict()

    same, different = weights(again[0]), weights(other[0])
    for name, tensor in weights(first[0]).items():
        assert torch.equal(tensor, same[name]), name
    assert any(not torch.equal(t, different[n]) for n, t in weights(first[0]).items())
    # Target and draft are not copies of each other.
    assert weights(first[1])["model.embed_tokens.weight"].shape[1] == 32


def test_tiny_pair_is_reused_when_complete_and_rebuilt_when_not(tmp_path):
    target_dir, draft_dir = build_tiny_pair(tmp_path, arch="gpt2", seed=0)
    weights = target_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert build_tiny_pair(tmp_path, arch="gpt2", seed=0) == (target_dir, draft_dir)
    assert weights.stat().st_mtime_ns == mtime

    # A different seed rebuilds in place; a damaged marker (an interrupted copy) rebuilds too.
    build_tiny_pair(tmp_path, arch="gpt2", seed=1)
    assert json.loads((target_dir / MARKER_FILE).read_text())["seed"] == 1
    (draft_dir / MARKER_FILE).write_text("{not json")
    build_tiny_pair(tmp_path, arch="gpt2", seed=1)
    assert json.loads((draft_dir / MARKER_FILE).read_text())["role"] == "draft"
    # No staging directories are left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-gpt2-draft", "tiny-gpt2-target"]


def test_tiny_pair_refuses_an_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        build_tiny_pair(tmp_path, arch="mamba")
