"""Model variants in the registry: built by a command and the admin, loaded by the worker, promoted
like any version (which invalidates the prediction cache of what they replace)."""
from __future__ import annotations

import os
import subprocess
import sys
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from sessions.submission import prediction_cache
from inference.engine import GenerationConfig, SpeculativeDecoder, build_drafter
from inference.engine.decode.target_only import generate_plain
from inference.engine.lm.variants import Int8Linear
from metadata.models import ModelVersion, VariantKind, VersionStatus
from inference.variant_registry import VariantBuildError, build_variant
from inference.worker.residency import ModelResidency
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT


@pytest.fixture(scope="module", autouse=True)
def single_thread_torch():
    """One intra-op thread, as in tests/inference/engine: the tiny models' forwards on a second
    thread of a shared 2-core machine mostly wait (the variant builds measure on one already)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _build(*args: str) -> str:
    out = StringIO()
    call_command("build_variants", *args, stdout=out)
    return out.getvalue()


def test_build_variants_registers_a_staged_int8_draft_with_its_recipe_and_figures(tiny_model):
    output = _build("tiny", "1", "--kind", "int8", "--role", "draft")
    variant = ModelVersion.objects.get(name="tiny", version="1+int8", role="draft")
    draft = tiny_model.default_draft
    assert "registered tiny:1+int8 (draft) (staged)" in output and "top-1 agreement" in output
    assert variant.variant == VariantKind.INT8 and variant.base_id == draft.pk
    assert variant.status == VersionStatus.STAGED and variant.default_draft is None
    assert variant.directory == draft.directory.parent / f"{draft.directory.name}.int8"
    assert variant.recipe["kind"] == "int8" and variant.recipe["options"]["activations"] == "per_tensor"
    assert variant.recipe["weights_digest"] and variant.recipe["source_digest"]
    figures = variant.figures
    # not smaller here: the tiny GPT-2 ties its head to the embedding, which int8 unties
    assert figures["size_bytes"] > 0 and figures["base_size_bytes"] > 0 and figures["threads"] == 1
    assert figures["forward_ms_1"] > 0 and figures["agreement_positions"] > 0
    assert 0.0 <= figures["top1_agreement_with_base"] <= 1.0
    # building again refreshes the same row, never a second one
    _build("tiny", "1", "--kind", "int8", "--role", "draft")
    assert ModelVersion.objects.filter(base=draft, variant="int8").count() == 1


def test_a_target_variant_keeps_the_targets_draft_and_quantises_per_token(tiny_model):
    _build("tiny", "1", "--kind", "int8", "--no-measure")
    variant = ModelVersion.objects.get(name="tiny", version="1+int8", role="target")
    assert variant.default_draft_id == tiny_model.default_draft_id
    assert variant.recipe["options"]["activations"] == "per_token"
    assert "forward_ms_1" not in variant.figures and variant.figures["size_bytes"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (["tiny", "1", "--kind", "int4"], "--kind must be one of int8, bf16, compiled, not 'int4'"),
    (["tiny", "9", "--kind", "int8"], "no target version tiny:9 is registered"),
    (["tiny", "1", "--kind", "int8", "--role", "teacher"], "--role must be one of target, draft, not 'teacher'"),
])
def test_bad_input_is_a_one_line_error(tiny_model, args, message):
    with pytest.raises(CommandError) as error:
        _build(*args)
    assert str(error.value) == message
    assert not ModelVersion.objects.exclude(variant=VariantKind.ORIGINAL).exists()


def test_a_variant_of_a_variant_is_refused(tiny_model):
    _build("tiny", "1", "--kind", "int8", "--role", "draft", "--no-measure")
    with pytest.raises(CommandError, match=r"tiny:1\+int8 \(draft\) is itself a int8 variant"):
        _build("tiny", "1+int8", "--kind", "bf16", "--role", "draft")


def test_the_command_exits_non_zero_with_one_line_on_stderr(tiny_model):
    from django.db import connection

    db = connection.settings_dict  # the test database: the command's lookup reads it, finds nothing
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    env = {**os.environ, "DEBUG": "true", "SECRET_KEY": os.environ.get("SECRET_KEY") or "x",
           "DATABASE_URL": url, "DATABASE_REPLICA_URLS": ""}
    result = subprocess.run([sys.executable, "manage.py", "build_variants", "nosuch", "1", "--kind", "int8"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == "CommandError: no target version nosuch:1 is registered"


def test_the_worker_loads_a_variant_like_any_version_and_its_greedy_output_is_the_targets(tiny_model):
    draft_variant = build_variant(tiny_model.default_draft, "int8", measure=False)
    residency = ModelResidency(capacity=4)
    target, draft = residency.get(tiny_model), residency.get(draft_variant)
    assert isinstance(draft.model.lm_head, Int8Linear) and residency.get(draft_variant) is draft
    prompt = target.tokenizer("def main():\n    return", add_special_tokens=False)["input_ids"]
    generation = GenerationConfig(max_new_tokens=24)
    decoder = SpeculativeDecoder(target, build_drafter("draft_model", target=target, draft=draft))
    assert decoder.generate(prompt, generation).token_ids == generate_plain(target, prompt, generation).token_ids


def test_promoting_a_draft_variant_retires_the_draft_repoints_the_target_and_invalidates_the_cache(
        tiny_model, tenant, django_capture_on_commit_callbacks):
    draft = tiny_model.default_draft
    variant = build_variant(draft, "int8", measure=False)
    key = prediction_cache.request_key(tenant.pk, tiny_model.pk, draft.pk, "draft_model", "x", {"temperature": 0.0},
                                       deterministic=True)
    result = {"text": "cached", "token_count": 1, "finish_reason": "eos", "stats": {}, "source_session": "-"}
    assert prediction_cache.store(key, result) and prediction_cache.lookup(key) is not None
    with django_capture_on_commit_callbacks(execute=True):
        replaced = variant.promote()
    assert [v.pk for v in replaced] == [draft.pk]
    draft.refresh_from_db(), tiny_model.refresh_from_db()
    assert draft.status == VersionStatus.RETIRED and tiny_model.default_draft_id == variant.pk
    assert prediction_cache.lookup(key) is None  # the replaced draft's entries are orphaned
    # and back: the original draft replaces its variant the same way
    with django_capture_on_commit_callbacks(execute=True):
        draft.promote()
    tiny_model.refresh_from_db()
    assert tiny_model.default_draft_id == draft.pk


def test_promoting_a_draft_of_another_family_leaves_the_targets_draft_alone(tiny_model, tiny_model_dirs):
    from inference.registry import register_version

    other = register_version("tiny", "2", "draft", tiny_model_dirs[1])
    other.promote()
    tiny_model.refresh_from_db()
    assert tiny_model.default_draft.version == "1"


def test_the_model_page_shows_variants_side_by_side_and_promotes_one(admin_client, tiny_model):
    page = admin_client.post("/admin/metadata/modelversion/", {
        "action": "build_int8_variant", "_selected_action": [tiny_model.pk]}, follow=True).content.decode()
    variant = ModelVersion.objects.get(base=tiny_model, variant="int8")
    assert "Built" in page and "tiny:1+int8 (target)" in page
    build_variant(tiny_model, "bf16")
    html = admin_client.get(f"/admin/metadata/modelversion/{tiny_model.pk}/change/").content.decode()
    table = html[html.index('<table class="variants">'):]
    table = table[:table.index("</table>")]
    assert table.count("<tr>") == 4  # header, the original, int8, bf16
    assert ">1+int8</a>" in table and ">1+bf16</a>" in table and "(this page)" in table
    assert f"{variant.figures['size_bytes'] / 1e6:.2f}" in table
    assert f"{variant.figures['top1_agreement_with_base']:.3f}" in table
    assert "activations=per_token" in table
    variant_page = admin_client.get(f"/admin/metadata/modelversion/{variant.pk}/change/").content.decode()
    assert '<table class="variants">' in variant_page  # the same family table from a variant's page
    done = admin_client.post(f"/admin/metadata/modelversion/{variant.pk}/promote/", {"confirmed": "yes"},
                             follow=True).content.decode()
    assert "Promoted tiny:1+int8 (target): it is active; retired: tiny:1 (target)" in done
    variant.refresh_from_db(), tiny_model.refresh_from_db()
    assert variant.status == VersionStatus.ACTIVE and tiny_model.status == VersionStatus.RETIRED


def test_a_failed_build_is_reported_and_writes_nothing(admin_client, tiny_model):
    variant = build_variant(tiny_model, "int8", measure=False)
    page = admin_client.post("/admin/metadata/modelversion/", {
        "action": "build_bf16_variant", "_selected_action": [variant.pk]}, follow=True).content.decode()
    assert "is itself a int8 variant" in page
    assert not ModelVersion.objects.filter(variant="bf16").exists()
    with pytest.raises(VariantBuildError, match="kind must be one of"):
        build_variant(tiny_model, "fp8")
