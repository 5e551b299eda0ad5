"""Training a DSpark drafter: the training forward is the drafter's own model, training makes it
draft better, calibration does not make its survival estimates worse, and a killed run resumes."""
from __future__ import annotations

import json

import pytest
import torch

from inference.engine import DraftConfig
from inference.engine.drafters.base import DraftRequest
from inference.engine.drafters.dspark import DSparkDrafter, load_dspark
from inference.engine.drafters.dspark.calibration import (
    expected_calibration_error,
    fit_temperatures,
    per_position_ece,
    running_survival,
)
from inference.engine.drafters.dspark.sequences import continue_sequences
from inference.engine.drafters.dspark.training import (
    REPORT_FILE,
    default_target_layer_ids,
    draft_config,
    init_from_target,
    train_dspark,
    work_directory,
)
from inference.engine.drafters.dspark.training_forward import block_forward, sample_anchors, target_pass
from inference.engine.lm.modeling import logits_width

from .conftest import VOCAB_SIZE, target_model

LAYERS = (-1, 0)  # the tiny Llama target has 2 layers: its embeddings and its first layer
SMALL = dict(block_size=4, markov_rank=8, target_layer_ids=LAYERS)


@pytest.fixture(scope="module")
def target():
    return target_model("llama")


@pytest.fixture(scope="module")
def text(target):
    """Sequences the target wrote: sampled ones to train on, greedy held-out ones."""
    generator = torch.Generator().manual_seed(0)
    train = continue_sequences(target, torch.randint(2, VOCAB_SIZE, (48, 6), generator=generator), 34,
                               temperature=1.0, seed=1)
    heldout = continue_sequences(target, torch.randint(2, VOCAB_SIZE, (16, 6), generator=generator), 34)
    return train, heldout


def _drafter_proposal(target, model, context, depth):
    drafter = DSparkDrafter(model, logits_width(target), DraftConfig())
    drafter.begin(context)
    drafter.observe_target_features(target_pass(target, torch.tensor([context[:-1]]), LAYERS).features)
    return drafter, drafter.propose(context, DraftRequest(depth))


def test_the_training_forward_is_the_drafters_own_forward(target):
    """Greedy proposal through the drafter == argmax of the training forward at that anchor, with
    other anchors' blocks in the same forward: the two paths run one model, one mask."""
    model = init_from_target(target, draft_config(target, **SMALL), seed=3).double().eval()
    context = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12]
    drafter, tree = _drafter_proposal(target, model, context, depth=4)
    drafted = list(tree.token_ids)
    assert len(drafted) == 4
    # the sequence as it reads once the block is accepted: teacher forcing = the drafted tokens
    sequence = torch.tensor([context + drafted[:-1]])
    anchor = len(context) - 1
    anchors = torch.tensor([[1, 4, anchor, anchor + 2]])  # other blocks, before and overlapping after
    passed = target_pass(target, sequence, LAYERS)
    with torch.no_grad():
        output = block_forward(model, sequence, anchors, passed.features, passed.logits)
        logits = output.logits[0, 2]  # [γ, vocab] of the anchor's block
        hidden = model.block_hidden(model.block_ids(torch.tensor([context[-1]])), torch.tensor([anchor]),
                                    drafter.context.keys, drafter.context.values)[0]
        first = model.markov_logits(model.lm_head(hidden[:1]), torch.tensor([context[-1]]), hidden[:1])[0]
    assert logits.argmax(dim=-1).tolist() == drafted
    torch.testing.assert_close(logits[0], first, rtol=1e-9, atol=1e-9)
    log_q = logits.log_softmax(dim=-1)
    # the drafter reports its log-probabilities in float32
    torch.testing.assert_close(log_q[torch.arange(4), drafted], torch.tensor(tree.log_probs, dtype=log_q.dtype),
                               rtol=1e-6, atol=1e-6)
    confidence = model.confidence_logits(hidden, torch.tensor([context[-1]] + drafted[:-1]))
    torch.testing.assert_close(output.confidence[0, 2], confidence, rtol=1e-9, atol=1e-9)


def test_a_block_does_not_see_the_sequence_after_its_anchor(target):
    model = init_from_target(target, draft_config(target, **SMALL), seed=3).double().eval()
    base = torch.tensor([[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12, 40]])
    changed = base.clone()
    changed[0, 7:] = torch.tensor([1, 1, 1, 1, 1])
    anchors = torch.tensor([[6]])
    outputs = []
    for tokens in (base, changed):
        passed = target_pass(target, tokens, LAYERS)
        with torch.no_grad():
            outputs.append(block_forward(model, tokens, anchors, passed.features).logits[0, 0, 0])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-9, atol=1e-9)


def test_anchors_are_distinct_and_leave_a_label():
    anchors = sample_anchors(3, 10, 50, torch.Generator().manual_seed(0))
    assert anchors.shape == (3, 9)
    assert all(row.tolist() == list(range(9)) for row in anchors)
    few = sample_anchors(2, 40, 5, torch.Generator().manual_seed(1))
    assert few.shape == (2, 5) and int(few.max()) < 39
    assert all(len(set(row.tolist())) == 5 for row in few)


def test_default_feature_layers_stay_below_the_last():
    assert default_target_layer_ids(2) == (-1, 0)
    assert default_target_layer_ids(20) == (1, 9, 18)
    assert all(max(default_target_layer_ids(n)) < n - 1 for n in range(1, 40))


def test_the_backbone_can_start_from_the_targets_top_layer(target):
    model = init_from_target(target, draft_config(target, **SMALL), top_layers=True)
    top = target.model.layers[-1]
    for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight",
                 "post_attention_layernorm.weight"):
        assert torch.equal(model.layers[0].get_submodule(name.rsplit(".", 1)[0]).weight,
                           top.get_submodule(name.rsplit(".", 1)[0]).weight.float()), name
    fresh = init_from_target(target, draft_config(target, **SMALL))
    assert not torch.equal(fresh.layers[0].mlp.down_proj.weight, model.layers[0].mlp.down_proj.weight)


@pytest.fixture(scope="module")
def trained(target, text, tmp_path_factory):
    out = tmp_path_factory.mktemp("dspark") / "tiny-dspark"
    report = train_dspark(target, text[0], out, heldout=text[1], budget_s=120.0, max_steps=150,
                          anchors_per_sequence=16, lr=3e-3, **SMALL)
    return out, report


def test_training_lowers_the_loss_and_raises_heldout_acceptance(trained):
    out, report = trained
    initial, final = report["initial"], report["final"]
    assert report["steps"] == 150
    assert final["loss"] < 0.9 * initial["loss"]
    assert final["tau_sampled"] > initial["tau_sampled"] + 0.2
    assert final["tau_greedy"] > initial["tau_greedy"] + 0.1
    assert final["greedy_hit"][0] > initial["greedy_hit"][0]


def test_the_checkpoint_loads_as_the_targets_drafter_with_its_temperatures(target, trained):
    out, report = trained
    model = load_dspark(out, target)
    assert model.calibration == report["temperatures"] and len(model.calibration) == 4
    assert json.loads((out / REPORT_FILE).read_text())["steps"] == 150
    assert not work_directory(out).exists()  # the resumable state is gone once published
    assert model.embed_tokens.weight.equal(target.get_input_embeddings().weight)  # frozen, shared


def test_calibration_makes_heldout_ece_no_worse(trained):
    _, report = trained
    # fitted on one half of the held-out blocks, measured on the other
    assert report["ece_calibrated"] <= report["ece_uncalibrated"] + 1e-9


def test_temperature_scaling_fixes_an_overconfident_head():
    generator = torch.Generator().manual_seed(0)
    true_logits = torch.randn(4000, 3, generator=generator)
    accept = (torch.rand(4000, 3, generator=generator) < torch.sigmoid(true_logits)).double()
    overconfident = 3.0 * true_logits  # the head says 0.95 where the truth is 0.73
    valid = torch.ones(4000, 3, dtype=torch.bool)
    fit, check = slice(0, 2000), slice(2000, None)
    temperatures = fit_temperatures(overconfident[fit], accept[fit], valid[fit])
    assert all(2.0 < t < 4.5 for t in temperatures)
    before = per_position_ece(overconfident[check], accept[check], valid[check])
    after = per_position_ece(overconfident[check], accept[check], valid[check], temperatures)
    assert all(a < 0.5 * b for a, b in zip(after, before))
    survival = running_survival(overconfident, temperatures)
    assert bool((survival[:, 1:] <= survival[:, :-1]).all())
    assert expected_calibration_error(torch.tensor([0.2, 0.8]), torch.tensor([0.2, 0.8])) == 0.0


def test_a_killed_run_resumes_where_it_stopped_and_ends_as_an_unbroken_one(target, text, tmp_path):
    settings = dict(heldout=text[1][:2], budget_s=1e9, max_steps=8, checkpoint_every_s=0.0,
                    anchors_per_sequence=8, **SMALL)

    def kill_at_step_5(event):
        if event.stage == "train" and event.step == 5:
            raise KeyboardInterrupt

    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        train_dspark(target, text[0], out, progress=kill_at_step_5, **settings)
    assert not out.exists()  # nothing half-written
    assert (work_directory(out) / "state.pt").is_file()
    resumed = train_dspark(target, text[0], out, **settings)
    assert resumed["resumed_from"] == 5 and resumed["steps"] == 8
    unbroken = train_dspark(target, text[0], tmp_path / "unbroken", **settings)
    assert unbroken["resumed_from"] == 0
    for name, tensor in load_dspark(out).state_dict().items():
        assert torch.equal(tensor, load_dspark(tmp_path / "unbroken").state_dict()[name]), name


def test_no_resume_starts_afresh(target, text, tmp_path):
    settings = dict(heldout=text[1][:2], budget_s=1e9, max_steps=4, checkpoint_every_s=0.0,
                    anchors_per_sequence=8, **SMALL)

    def kill_at_step_3(event):
        if event.stage == "train" and event.step == 3:
            raise KeyboardInterrupt

    out = tmp_path / "fresh"
    with pytest.raises(KeyboardInterrupt):
        train_dspark(target, text[0], out, progress=kill_at_step_3, **settings)
    assert train_dspark(target, text[0], out, resume=False, **settings)["resumed_from"] == 0


def test_bad_input_is_refused(target, tmp_path):
    with pytest.raises(ValueError, match="length >= 2"):
        train_dspark(target, [[3]], tmp_path / "x", max_steps=1)
    with pytest.raises(ValueError, match="target_layer_ids"):
        train_dspark(target, [[3, 4, 5]] * 4, tmp_path / "x", target_layer_ids=(0, 1), max_steps=1)
    assert not (tmp_path / "x").exists()
