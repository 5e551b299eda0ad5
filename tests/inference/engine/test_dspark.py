"""The `dspark` drafter: DeepSpec's checkpoint layout loads, features come from the target's own
forwards, and output stays the target's own (greedy token for token; sampling in distribution)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from inference.engine import DraftConfig, GenerationConfig, SpeculativeDecoder, build_drafter
from inference.engine.decode.sampling import SamplingParams
from inference.engine.decode.target_only import generate_plain
from inference.engine.drafters.dspark import DSparkLoadError, load_dspark, save_dspark
from inference.engine.errors import ConfigError

from .chi_square import exact_joint, joint_p_value
from .conftest import target_model
from .dspark_models import deepspec_weight_names, qwen3_target, write_deepspec_checkpoint

PROMPTS = ([3, 1, 4, 1, 5], [9, 2, 6], [7] * 12, [2, 7, 1, 8, 2, 8, 1, 8, 2, 8])


@pytest.fixture(scope="module")
def qwen3():
    return qwen3_target()


@pytest.fixture(scope="module")
def checkpoint(qwen3, tmp_path_factory):
    return write_deepspec_checkpoint(tmp_path_factory.mktemp("dspark") / "ckpt", qwen3)


def test_deepspec_layout_loads_under_deepspec_parameter_names(qwen3, checkpoint):
    assert set(load_file(checkpoint / "model.safetensors")) == deepspec_weight_names(1, 8)
    model = load_dspark(checkpoint, qwen3)
    assert model.block_size == 4 and model.dspark.target_layer_ids == (0, 1)
    assert model.fc.weight.dtype == qwen3.dtype
    assert model.calibration is None  # DeepSpec writes no calibration.json


def test_a_checkpoint_for_another_target_is_refused_by_name(checkpoint, tmp_path):
    with pytest.raises(DSparkLoadError, match="layers"):
        load_dspark(checkpoint, target_model("llama"))  # 2 layers, trained for 3
    with pytest.raises(DSparkLoadError, match="vocabulary"):
        load_dspark(checkpoint, qwen3_target(vocab_size=96))


@pytest.mark.parametrize(("change", "message"), [
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures"),
    ({"target_layer_ids": [1, 0]}, "strictly increasing"),
    ({"target_layer_ids": [0, 2]}, "last layer"),
    ({"markov_head_type": "lstm"}, "markov_head_type"),
    ({"block_size": 0}, "block_size"),
])
def test_a_malformed_config_is_refused_naming_the_field(qwen3, checkpoint, tmp_path, change, message):
    broken = tmp_path / "broken"
    broken.mkdir()
    raw = json.loads((checkpoint / "config.json").read_text()) | change
    (broken / "config.json").write_text(json.dumps(raw))
    (broken / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes())
    with pytest.raises(DSparkLoadError, match=message):
        load_dspark(broken, qwen3)


def test_missing_weights_are_refused_not_left_random(qwen3, checkpoint, tmp_path):
    from safetensors.torch import save_file
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((checkpoint / "config.json").read_text())
    weights = load_file(checkpoint / "model.safetensors")
    del weights["fc.weight"]
    save_file(weights, partial / "model.safetensors")
    with pytest.raises(DSparkLoadError, match="fc.weight"):
        load_dspark(partial, qwen3)


def test_save_then_load_round_trips(qwen3, checkpoint, tmp_path):
    model = load_dspark(checkpoint, qwen3)
    again = load_dspark(save_dspark(model, tmp_path / "copy", temperatures=[1.0, 1.5, 2.0, 2.5]), qwen3)
    assert again.calibration == [1.0, 1.5, 2.0, 2.5]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def _decoder(target, dspark, **config):
    return SpeculativeDecoder(target, build_drafter("dspark", target, config=DraftConfig(**config), dspark=dspark))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_is_the_targets_own(qwen3, checkpoint, prompt):
    decoder = _decoder(qwen3, load_dspark(checkpoint, qwen3))
    config = GenerationConfig(max_new_tokens=24, eos_token_id=())
    assert decoder.generate(prompt, config).token_ids == generate_plain(qwen3, prompt, config).token_ids
    assert decoder.stats.drafted > 0


def test_the_lean_forward_path_feeds_the_same_features(tmp_path):
    """A Llama target runs the engine's own module-by-module forward, not transformers' hooks."""
    target = target_model("llama")
    dspark = load_dspark(write_deepspec_checkpoint(tmp_path / "llama-dspark", target,
                                                   target_layer_ids=(-1, 0)), target)
    decoder = _decoder(target, dspark)
    prompt, config = PROMPTS[0], GenerationConfig(max_new_tokens=20, eos_token_id=())
    result = decoder.generate(prompt, config)
    assert result.token_ids == generate_plain(target, prompt, config).token_ids
    _assert_context_is_the_targets_features(target, dspark, decoder.drafter, prompt + result.token_ids)


def test_the_drafter_holds_every_committed_positions_features_once(qwen3, checkpoint):
    dspark = load_dspark(checkpoint, qwen3)
    decoder = _decoder(qwen3, dspark)
    prompt = PROMPTS[3]
    result = decoder.generate(prompt, GenerationConfig(max_new_tokens=30, eos_token_id=()))
    _assert_context_is_the_targets_features(qwen3, dspark, decoder.drafter, prompt + result.token_ids)


def _assert_context_is_the_targets_features(target, dspark, drafter, tokens):
    committed = tokens[:-1]  # the last token is pending: the target has not read it
    assert drafter.context.length == len(committed)
    with torch.inference_mode():
        hidden = target(torch.tensor([committed]), output_hidden_states=True).hidden_states
        # DeepSpec's extract_context_feature: layer id l is hidden_states[l + 1] (-1: embeddings)
        features = torch.cat([hidden[layer + 1] for layer in dspark.dspark.target_layer_ids], dim=-1)
        from inference.engine.drafters.dspark.modeling import ContextCache
        expected = ContextCache()
        dspark.extend_context(expected, features)
    for got, want in zip(drafter.context.keys, expected.keys):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_survival_estimates_are_a_non_increasing_running_product(qwen3, checkpoint):
    from inference.engine.drafters.base import DraftRequest
    tree = _fresh_proposal(qwen3, checkpoint, PROMPTS[0] + [0], DraftRequest(4))
    assert len(tree.survival) == len(tree) == 4
    assert all(0.0 < b <= a <= 1.0 for a, b in zip(tree.survival, tree.survival[1:]))


def _fresh_proposal(target, checkpoint, context, request):
    dspark = load_dspark(checkpoint, target)
    drafter = build_drafter("dspark", target, dspark=dspark)
    drafter.begin(context)
    with torch.inference_mode():
        hidden = target(torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states
    drafter.observe_target_features(torch.cat([hidden[i + 1] for i in dspark.dspark.target_layer_ids], dim=-1))
    return drafter.propose(context, request)


def test_a_confidence_threshold_cuts_the_block_without_changing_the_output(qwen3, checkpoint):
    plain = _decoder(qwen3, load_dspark(checkpoint, qwen3))
    cut = _decoder(qwen3, load_dspark(checkpoint, qwen3), confidence_threshold=0.6)
    config = GenerationConfig(max_new_tokens=24, eos_token_id=())
    assert cut.generate(PROMPTS[1], config).token_ids == plain.generate(PROMPTS[1], config).token_ids
    assert cut.stats.drafted < plain.stats.drafted


def test_dspark_needs_its_checkpoint():
    with pytest.raises(ConfigError, match="DSpark checkpoint"):
        build_drafter("dspark", target_model("llama"))


# 1,000 runs over the 12 cells the warped target can emit reject a deviation of w >= 0.23 at
# p < 1e-3 with power 0.99 (chi_square.py; the residual bug is w >= 0.38 on the 8-token llama
# pair); 2,500 resolved w >= 0.14 at 2.5x the CPU.
VOCAB, RUNS, PROMPT = 8, 1000, [3, 1, 4]


# Plain T = 1 is the batched engine's chi-square test (test_dspark_batched.py); here the warped case.
@pytest.mark.parametrize("generation", [dict(temperature=0.8, top_k=6, top_p=0.9)])
def test_sampling_with_dspark_follows_the_target_distribution(tmp_path, generation):
    target = qwen3_target(vocab_size=VOCAB, seed=11)
    dspark = load_dspark(write_deepspec_checkpoint(tmp_path / "v8", target, block_size=2, markov_rank=4,
                                                   mask_token_id=VOCAB - 1), target)
    decoder = _decoder(target, dspark)
    counts = np.zeros(VOCAB * VOCAB)
    for seed in range(RUNS):
        tokens = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=3, seed=seed, eos_token_id=(),
                                                           **generation)).token_ids
        counts[tokens[0] * VOCAB + tokens[1]] += 1
    params = SamplingParams(generation["temperature"], generation.get("top_k", 0), generation.get("top_p", 1.0))
    assert decoder.stats.drafted > 0
    assert joint_p_value(counts, exact_joint(target, PROMPT, VOCAB, params)) > 1e-3


def test_one_batched_forward_drafts_what_each_row_drafts_alone(qwen3, checkpoint):
    """Rows of different context lengths, padded into one backbone forward: the same greedy blocks."""
    from inference.engine.drafters.base import DraftRequest
    from inference.engine.drafters.dspark.batched import propose_blocks

    contexts = [PROMPTS[0] + [0], PROMPTS[2] + [5, 6], PROMPTS[1] + [1]]
    requests = [DraftRequest(4), DraftRequest(3), DraftRequest(0)]
    alone = [_fresh_proposal(qwen3, checkpoint, context, request) for context, request in zip(contexts, requests)]
    dspark = load_dspark(checkpoint, qwen3)
    drafters = []
    for context in contexts:
        drafter = build_drafter("dspark", qwen3, dspark=dspark)
        drafter.begin(context)
        with torch.inference_mode():
            hidden = qwen3(torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states
        drafter.observe_target_features(torch.cat([hidden[i + 1] for i in (0, 1)], dim=-1))
        drafters.append(drafter)
    together = propose_blocks(drafters, contexts, requests)
    assert [t.token_ids for t in together] == [t.token_ids for t in alone]
    assert len(together[2]) == 0
    for got, want in zip(together[:2], alone[:2]):
        assert got.survival == pytest.approx(want.survival, rel=1e-6)
