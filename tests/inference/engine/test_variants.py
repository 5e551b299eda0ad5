"""Optimised variants (inference.engine.lm.variants) keep speculative decoding exact.

* an int8 *draft* never changes the output: greedy speculative == the target's own greedy, token
  for token (single sequence and batched), and sampling stays the target's distribution;
* an int8 *target* is another model, but its speculative greedy output equals its own
  target-only greedy output, which needs per-token activation scales (the negative control shows
  that plain per-tensor dynamic quantisation makes a row's output depend on its neighbours);
* variant directories round-trip through `load_causal_lm`, and a changed base is refused.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
from torch import nn

from inference.engine import DraftConfig, GenerationConfig, SpeculativeDecoder, build_drafter
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.kv.rollback import new_cache
from inference.engine.lm.loading import ModelLoadError, load_causal_lm
from inference.engine.lm.modeling import forward_logits
from inference.engine.decode.draft_tree import DraftTree, tree_attention_mask, tree_position_ids
from inference.engine.decode.sampling import SamplingParams
from inference.engine.decode.target_only import generate_plain
from inference.engine.lm.variant_writer import build_variant_dir
from inference.engine.lm.variants import (
    VARIANT_FILE,
    Int8Linear,
    int8_weights_digest,
    model_size_bytes,
    quantize_int8,
    read_recipe,
    top1_agreement,
)

from .chi_square import exact_joint, joint_p_value
from .conftest import ARCHS, VOCAB_SIZE, noisy_copy, target_model

PROMPT_COUNT = 6
MAX_NEW = 32


def _prompts(count: int = PROMPT_COUNT, vocab: int = VOCAB_SIZE) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 24, (count,), generator=generator).tolist()
    return [torch.randint(vocab, (n,), generator=generator).tolist() for n in lengths]


def _int8(model: nn.Module, per_token: bool) -> nn.Module:
    return quantize_int8(copy.deepcopy(model).float(), per_token=per_token)


def _speculative(target, draft, prompt, generation, length=4):
    decoder = SpeculativeDecoder(target, build_drafter("draft_model", target=target, draft=draft,
                                                       config=DraftConfig(length=length)))
    return decoder.generate(prompt, generation)


def _batched(target, draft, prompts, generation, length=4) -> dict[int, list[int]]:
    engine = BatchedSpeculativeEngine(target, draft)
    for index, prompt in enumerate(prompts):
        engine.submit(BatchRequest(index, prompt, generation, "draft_model", DraftConfig(length=length)))
    out: dict[int, list[int]] = {index: [] for index in range(len(prompts))}
    while engine.has_work():
        for event in engine.step():
            out[event.request_id].extend(event.step.token_ids)
    return out


# ------------------------------------------------------------------------------ the int8 layer


@pytest.mark.parametrize("per_token", [True, False])
def test_a_rows_int8_output_depends_on_its_neighbours_only_without_per_token_scales(per_token):
    torch.manual_seed(0)
    layer = Int8Linear(nn.Linear(32, 16), per_token=per_token)
    rows = torch.randn(4, 32)
    rows[3] *= 50  # one row with a much wider range, as a long-context row in a batch may have
    together = layer(rows[None])[0, :3]
    alone = torch.cat([layer(rows[None, i:i + 1])[0] for i in range(3)])
    if per_token:
        assert torch.equal(together, alone)
    else:  # the negative control: one activation scale for the whole tensor
        assert (together - alone).abs().max() > 1e-2


def test_int8_layer_stays_a_linear_close_to_the_float_one():
    torch.manual_seed(1)
    linear = nn.Linear(64, 48)
    layer = Int8Linear(linear)
    x = torch.randn(5, 64)
    assert isinstance(layer, nn.Linear) and layer.weight.shape == linear.weight.shape
    error = (layer(x) - linear(x)).abs().max() / linear(x).abs().max()
    assert 0 < error < 0.05  # quantised (not a copy of the float layer), but close


@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_int8_replaces_every_linear_and_the_head(arch):
    model = _int8(target_model(arch), per_token=True)
    leftover = [name for name, m in model.named_modules()
                if type(m) is nn.Linear or type(m).__name__ == "Conv1D"]
    assert leftover == []
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    assert model.get_output_embeddings().weight.shape[0] == VOCAB_SIZE
    reference = copy.deepcopy(target_model(arch)).float()  # the cached model stays float64 for other tests
    agreement, positions = top1_agreement(reference, model, _prompts())
    assert positions > 0 and agreement > 0.8
    assert model_size_bytes(model) < 0.5 * model_size_bytes(reference)


# ------------------------------------------------------------------------------ int8 draft


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_draft_never_changes_greedy_output(arch):
    target = target_model(arch)
    draft = _int8(noisy_copy(arch, dtype=torch.float32), per_token=False)  # a draft's recipe
    generation = GenerationConfig(max_new_tokens=MAX_NEW)
    accepted = 0
    for prompt in _prompts():
        expected = generate_plain(target, prompt, generation)
        for length in (1, 4):
            result = _speculative(target, draft, prompt, generation, length)
            assert result.token_ids == expected.token_ids
            assert result.finish_reason == expected.finish_reason
            accepted += result.stats.accepted
    assert accepted > 0  # the int8 draft is accepted often enough to exercise both paths


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_int8_draft_in_the_batched_engine_keeps_every_rows_greedy_output(arch):
    target = target_model(arch)
    draft = _int8(noisy_copy(arch, dtype=torch.float32), per_token=False)
    generation = GenerationConfig(max_new_tokens=MAX_NEW, eos_token_id=())
    prompts = _prompts()
    expected = {i: generate_plain(target, p, generation).token_ids for i, p in enumerate(prompts)}
    assert _batched(target, draft, prompts, generation) == expected


def test_sampling_with_an_int8_draft_follows_the_target_distribution():
    # 1,500 runs over the 39 cells left after pooling reject a deviation of w >= 0.22 at p < 1e-3
    # with power 0.99, below the residual bug's 0.24 in the first token alone for this closer pair
    # (chi_square.py; 1,000 runs would resolve only 0.27); 2,500 resolved w >= 0.18.
    vocab, runs, prompt = 8, 1500, [3, 1, 4]
    target = target_model("llama", vocab_size=vocab)
    draft = _int8(noisy_copy("llama", noise=0.3, vocab_size=vocab), per_token=False)
    decoder = SpeculativeDecoder(target, build_drafter("draft_model", target=target, draft=draft,
                                                       config=DraftConfig(length=2)))
    counts, drafted, accepted = np.zeros(vocab * vocab), 0, 0
    for seed in range(runs):
        result = decoder.generate(prompt, GenerationConfig(max_new_tokens=3, seed=seed, temperature=1.0,
                                                           eos_token_id=()))
        counts[result.token_ids[0] * vocab + result.token_ids[1]] += 1
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    params = SamplingParams(1.0, 0, 1.0)
    assert 0 < accepted < drafted  # both the accept and the resample paths ran
    assert joint_p_value(counts, exact_joint(target, prompt, vocab, params)) > 1e-3
    # negative control: the same counts are far from the int8 draft's own distribution
    assert joint_p_value(counts, exact_joint(draft, prompt, vocab, params)) < 1e-6


# ------------------------------------------------------------------------------ int8 target


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_target_speculative_greedy_equals_its_own_greedy(arch):
    target = _int8(target_model(arch), per_token=True)  # a target's recipe
    drafts = {"fp32 draft": noisy_copy(arch, dtype=torch.float32),
              "int8 draft": _int8(noisy_copy(arch, dtype=torch.float32), per_token=False)}
    generation = GenerationConfig(max_new_tokens=MAX_NEW)
    for prompt in _prompts():
        expected = generate_plain(target, prompt, generation)
        for name, draft in drafts.items():
            for length in (2, 5):
                assert _speculative(target, draft, prompt, generation, length).token_ids == expected.token_ids, name


def test_int8_target_in_the_batched_engine_matches_its_own_greedy_per_row():
    target = _int8(target_model("llama"), per_token=True)
    draft = noisy_copy("llama", dtype=torch.float32)
    generation = GenerationConfig(max_new_tokens=MAX_NEW, eos_token_id=())
    prompts = _prompts()
    expected = {i: generate_plain(target, p, generation).token_ids for i, p in enumerate(prompts)}
    assert _batched(target, draft, prompts, generation) == expected


def _one_token_at_a_time(model, token_ids: list[int]) -> torch.Tensor:
    """The logits after `token_ids`, each token fed alone: the reference every forward must equal."""
    cache = new_cache(model)
    for token in token_ids:
        logits = forward_logits(model, [token], cache, keep=1)[0]
    return logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_int8_targets_verify_rows_equal_its_one_token_forwards_bit_for_bit(arch):
    """Why the speculative greedy above once differed (qwen2, at token 24): SDPA's low bits for a
    query depend on the other queries and the masked keys of its call, and the int8 layers after
    it turn such an ulp into a quantisation step. An int8 target attends query by query
    (kv/row_attention.py): a prefill, a verify's chain and a tree node whose keys have a gap
    all give the logits of one-token forwards bit for bit."""
    target = _int8(target_model(arch), per_token=True)
    prompt = _prompts()[2]
    tree = DraftTree([5, 9, 11, 7], [-1, -1, 1, 2], [0.0] * 4)  # node 2 skips node 0's key
    cached = len(prompt) - 1
    with torch.inference_mode():
        cache = new_cache(target)
        prefill = forward_logits(target, prompt[:-1], cache, keep=cached)
        mask = tree_attention_mask(tree.ancestor_matrix(), cached, 1, target.dtype, target.device)
        positions = tree_position_ids(tree.depths, cached, 1, target.device)
        verified = forward_logits(target, prompt[-1:] + tree.token_ids, cache, len(tree) + 1, mask, positions)
        chain = forward_logits(target, prompt + [9, 11, 7], new_cache(target), keep=4)
        for row in range(cached):
            assert torch.equal(prefill[row], _one_token_at_a_time(target, prompt[:row + 1]))
        for row, path in enumerate(([], [5], [9], [9, 11], [9, 11, 7])):
            expected = _one_token_at_a_time(target, prompt + path)
            assert torch.equal(verified[row], expected), path
            if path[:1] != [5]:  # on the chain prompt + [9, 11, 7] too
                assert torch.equal(chain[len(path)], expected), path


# ------------------------------------------------------------------------------ directories


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from inference.demo.tiny_models import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("variants"), arch="llama", seed=0)


def test_an_int8_variant_directory_is_a_recipe_that_loads_like_a_model(tiny_dirs):
    target_dir, draft_dir = tiny_dirs
    directory, recipe = build_variant_dir(draft_dir, "int8", role="draft")
    assert directory == draft_dir.parent / f"{draft_dir.name}.int8"
    assert not list(directory.glob("*.safetensors"))  # re-quantised at load, not stored
    assert (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()
    assert recipe.options["activations"] == "per_tensor" and read_recipe(directory) == recipe
    loaded = load_causal_lm(directory)
    assert loaded.path == directory and isinstance(loaded.model.lm_head, Int8Linear)
    assert int8_weights_digest(loaded.model) == recipe.weights_digest
    assert load_causal_lm(directory).model.lm_head.weight.equal(loaded.model.lm_head.weight)  # deterministic
    target = load_causal_lm(target_dir)
    generation = GenerationConfig(max_new_tokens=MAX_NEW)
    prompt = target.tokenizer("def main():\n    return", add_special_tokens=False)["input_ids"]
    assert _speculative(target, loaded, prompt, generation).token_ids == \
        generate_plain(target, prompt, generation).token_ids
    again, _ = build_variant_dir(draft_dir, "int8", role="draft")  # the same recipe: reused as is
    assert os.stat(again / VARIANT_FILE).st_mtime_ns == os.stat(directory / VARIANT_FILE).st_mtime_ns


def test_a_variant_whose_base_changed_is_refused(tmp_path, tiny_dirs):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_dirs[0], base)
    directory, _ = build_variant_dir(base, "int8", role="target")
    assert read_recipe(directory).options["activations"] == "per_token"
    weights = base / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="changed since the variant was built"):
        load_causal_lm(directory)
    shutil.rmtree(base)
    with pytest.raises(ModelLoadError, match="base model directory .* is missing"):
        load_causal_lm(directory)


def test_a_bf16_variant_stores_half_size_weights(tiny_dirs):
    target_dir, _ = tiny_dirs
    directory, recipe = build_variant_dir(target_dir, "bf16")
    assert recipe.source == "."
    saved = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    assert saved < 0.6 * sum(p.stat().st_size for p in target_dir.glob("*.safetensors"))
    loaded = load_causal_lm(directory)
    assert loaded.model.dtype == torch.bfloat16
    prompt = loaded.tokenizer("class A:\n    def f(self):", add_special_tokens=False)["input_ids"]
    generation = GenerationConfig(max_new_tokens=16)
    draft = load_causal_lm(tiny_dirs[1])
    assert _speculative(loaded, draft, prompt, generation).token_ids == \
        generate_plain(loaded, prompt, generation).token_ids


def test_a_compiled_variant_compiles_every_layer_at_load(tiny_dirs):
    directory, recipe = build_variant_dir(tiny_dirs[1], "compiled", role="draft")
    assert json.loads((directory / VARIANT_FILE).read_text())["options"]["backend"] == "inductor"
    model = load_causal_lm(directory).model  # compiling is lazy: nothing runs here
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)


def test_a_variant_of_a_variant_is_refused(tiny_dirs):
    from inference.engine.lm.variants import VariantError

    directory, _ = build_variant_dir(tiny_dirs[1], "int8", role="draft")
    with pytest.raises(VariantError, match="itself a variant"):
        build_variant_dir(directory, "bf16")
