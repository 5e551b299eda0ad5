"""A DSpark checkpoint registers as the drafter of a matching target, and only of one.

`register_model … --dspark DIR` checks the checkpoint against the target before anything is
written; a generation asking for `dspark` on a target without one is a 400 naming the drafter.
"""
from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from metadata.models import ModelVersion
from metadata.models import Session
from tests.inference.engine.dspark_models import write_deepspec_checkpoint

URL = "/api/v1/generations/"


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    from inference.demo.tiny_models import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("models"), arch="llama", seed=0)


@pytest.fixture(scope="module")
def checkpoints(llama_pair, tmp_path_factory):
    """One DSpark checkpoint trained (here: written) for the tiny Llama target, one for a stranger."""
    from inference.engine.lm.loading import load_causal_lm
    from tests.inference.engine.dspark_models import qwen3_target

    root = tmp_path_factory.mktemp("dspark")
    target = load_causal_lm(llama_pair[0]).model
    fits = write_deepspec_checkpoint(root / "fits", target, target_layer_ids=(-1, 0))
    stranger = write_deepspec_checkpoint(root / "stranger", qwen3_target(vocab_size=int(
        target.get_input_embeddings().weight.shape[0])))
    return fits, stranger


def register(*args) -> str:
    out = StringIO()
    call_command("register_model", *map(str, args), stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_a_fitting_checkpoint_registers_as_the_targets_dspark_drafter(llama_pair, checkpoints):
    target_dir, draft_dir = llama_pair
    printed = register("llama", "1", target_dir, "--draft", draft_dir, "--dspark", checkpoints[0])
    target = ModelVersion.objects.get(name="llama", role="target")
    assert target.dspark_directory == checkpoints[0]
    assert "with the DSpark drafter" in printed


@pytest.mark.django_db
def test_a_checkpoint_for_another_target_is_refused_and_nothing_is_written(llama_pair, checkpoints):
    target_dir, draft_dir = llama_pair
    with pytest.raises(CommandError, match="does not fit this target: target: has 2 layers") as refused:
        register("llama", "1", target_dir, "--draft", draft_dir, "--dspark", checkpoints[1])
    assert "\n" not in str(refused.value)
    assert not ModelVersion.objects.exists()


@pytest.mark.django_db
def test_a_directory_that_is_no_dspark_checkpoint_is_refused(llama_pair):
    target_dir, draft_dir = llama_pair
    with pytest.raises(CommandError, match="not a DSpark checkpoint"):
        register("llama", "1", target_dir, "--dspark", draft_dir.parent / "nowhere")
    with pytest.raises(CommandError, match="architectures"):
        register("llama", "1", target_dir, "--dspark", draft_dir)  # a causal LM, not a DSpark
    with pytest.raises(CommandError, match="only a target has a DSpark drafter"):
        register("llama", "1", draft_dir, "--role", "draft", "--dspark", draft_dir)
    assert not ModelVersion.objects.exists()


@pytest.mark.django_db
def test_asking_for_dspark_on_a_target_without_one_is_400_naming_the_drafter(api_client, tiny_model):
    response = api_client.post(URL, {"prompt": "def f():", "drafter": "dspark"}, format="json")
    assert response.status_code == 400, response.content
    assert "needs a DSpark drafter" in " ".join(response.json()["drafter"])
    assert not Session.objects.exists()
