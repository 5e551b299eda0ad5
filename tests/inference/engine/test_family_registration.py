"""`register_model` records how a model loads (attention, dtype) and refuses, in one line, what the engine cannot serve.

The refusal comes at registration, before anything is written, never at the model's first request.
"""
from __future__ import annotations

import json
from io import StringIO

import pytest
import torch
from django.core.management import CommandError, call_command
from transformers import AutoConfig, AutoModelForCausalLM

from inference.engine.lm.loading import load_causal_lm
from metadata.models import ModelVersion

from .family_models import save_family_pair, shared_tokenizer


def register(*args) -> str:
    out = StringIO()
    call_command("register_model", *map(str, args), stdout=out)
    return out.getvalue()


@pytest.mark.django_db
@pytest.mark.parametrize("family, attention", [("gemma2", "eager"), ("mistral", "sdpa")])
def test_a_pair_registers_with_the_attention_it_loads_with(family, attention, tmp_path):
    target_dir, draft_dir = save_family_pair(family, tmp_path)
    printed = register(family, "1", target_dir, "--draft", draft_dir)
    assert f"{attention} attention" in printed
    versions = ModelVersion.objects.filter(name=family)
    assert {version.role: version.attn_implementation for version in versions} == {
        "target": attention, "draft": attention}


@pytest.mark.django_db
def test_a_model_the_engine_cannot_serve_is_refused_at_registration_and_nothing_is_written(tmp_path):
    target_dir, draft_dir = save_family_pair("llama", tmp_path)
    hybrid = tmp_path / "linear-attention"
    AutoConfig.for_model("qwen3_next", num_hidden_layers=4, vocab_size=len(shared_tokenizer())).save_pretrained(hybrid)
    shared_tokenizer().save_pretrained(hybrid)
    for args in ((hybrid, "--draft", draft_dir), (target_dir, "--draft", hybrid)):
        with pytest.raises(CommandError, match="linear_attention layers; the engine serves full and sliding") as refused:
            register("odd", "1", *args)
        assert "\n" not in str(refused.value) and str(hybrid) in str(refused.value)
    assert not ModelVersion.objects.filter(name="odd").exists()


@pytest.mark.django_db
def test_a_half_precision_checkpoint_loads_in_float32_on_a_cpu_unless_registered_with_a_dtype(tmp_path):
    target_dir, _ = save_family_pair("qwen3", tmp_path)
    half = tmp_path / "half"
    AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).save_pretrained(half)
    shared_tokenizer().save_pretrained(half)
    assert load_causal_lm(half).model.dtype == torch.float32
    assert "bfloat16 dtype" in register("half", "1", half, "--role", "draft", "--dtype", "bfloat16")
    version = ModelVersion.objects.get(name="half")
    assert version.dtype == "bfloat16"
    assert load_causal_lm(version.directory, dtype=version.dtype or None).model.dtype == torch.bfloat16
    with pytest.raises(CommandError, match="invalid choice"):
        register("half", "2", half, "--dtype", "float8")


@pytest.mark.django_db
def test_registration_names_the_checkpoints_generation_settings_the_engine_does_not_apply(tmp_path):
    target_dir, draft_dir = save_family_pair("llama", tmp_path)
    assert "note:" not in register("plain", "1", target_dir, "--draft", draft_dir)
    settings = json.loads((target_dir / "generation_config.json").read_text())
    settings |= {"repetition_penalty": 1.05, "no_repeat_ngram_size": 0, "temperature": 0.7}
    (target_dir / "generation_config.json").write_text(json.dumps(settings))
    printed = register("penalised", "1", target_dir, "--draft", draft_dir)
    assert "generation_config.json sets repetition_penalty=1.05; the engine does not apply these" in printed
    assert ModelVersion.objects.filter(name="penalised").count() == 2  # noted, not refused
