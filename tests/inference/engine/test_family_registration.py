"""`register_model` records the attention a model loads with and refuses, in one line, what the engine cannot serve.

The refusal comes at registration, before anything is written, never at the model's first request.
"""
from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from transformers import AutoConfig

from inference.models import ModelVersion

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
