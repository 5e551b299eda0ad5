"""A registered version whose files are missing or unreadable: a 503 naming the model in both APIs,
unavailable in the admin and the metrics, the other models unaffected, and `make run`'s demo
registration serving a pair it has the files of."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from inference import version_files
from metadata.models import ModelVersion, VersionStatus
from inference.registry import register_demo_pair, register_pair
from metadata.models import Session
from ops.tasks import sample_ops_metrics

REST = "/api/v1/generations/"
CHAT = "/v1/chat/completions"


@pytest.fixture(autouse=True)
def fresh_answers():
    version_files.forget()
    yield
    version_files.forget()


def copy_pair(tiny_model_dirs, root: Path) -> tuple[Path, Path]:
    target_dir, draft_dir = tiny_model_dirs
    return (Path(shutil.copytree(target_dir, root / "target")), Path(shutil.copytree(draft_dir, root / "draft")))


@pytest.fixture
def gone(db, tiny_model_dirs, tmp_path) -> ModelVersion:
    """Model 'gone', active, registered from a copy of the tiny pair whose target directory is then removed."""
    target_dir, draft_dir = copy_pair(tiny_model_dirs, tmp_path)
    version = register_pair("gone", "1", target_dir, draft_dir)
    shutil.rmtree(target_dir)
    return version


def test_each_missing_part_is_named(tiny_model_dirs, tmp_path):
    target_dir, _ = copy_pair(tiny_model_dirs, tmp_path)
    assert version_files.missing_in(target_dir) is None
    assert version_files.missing_in(tmp_path / "nowhere") == f"its directory {tmp_path / 'nowhere'} does not exist"
    (tmp_path / "a-file").write_text("x")
    assert version_files.missing_in(tmp_path / "a-file") == f"{tmp_path / 'a-file'} is not a directory"

    def without(*names: str) -> str | None:
        for name in names:
            (target_dir / name).unlink()
        version_files.forget()  # within one tick of the clock the directory's mtime may not move
        return version_files.missing_in(target_dir)

    assert without("model.safetensors").startswith(f"{target_dir} holds no weights")
    assert without("tokenizer.json", "tokenizer_config.json").startswith(f"{target_dir} has no tokenizer files")
    assert without("config.json") == f"{target_dir} has no config.json"


def test_a_directory_found_whole_is_listed_again_once_a_file_goes(tiny_model_dirs, tmp_path):
    target_dir, _ = copy_pair(tiny_model_dirs, tmp_path)
    assert version_files.missing_in(target_dir) is None
    (target_dir / "model.safetensors").unlink()
    os.utime(target_dir, ns=(0, 0))  # the mtime a later tick of the clock gives it, whatever the clock's grain

    assert version_files.missing_in(target_dir).startswith(f"{target_dir} holds no weights")


@pytest.mark.django_db
def test_both_apis_answer_503_naming_the_model_and_what_is_missing(api_client, tiny_model, gone):
    missing = f"its directory {gone.directory} does not exist"

    rest = api_client.post(REST, {"prompt": "def f():", "model": "gone", "max_new_tokens": 4}, format="json")
    chat = api_client.post(CHAT, {"model": "gone", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 4}, format="json")
    completion = api_client.post("/v1/completions", {"model": "gone", "prompt": "x", "max_tokens": 4}, format="json")

    assert rest.status_code == 503, rest.content
    assert rest.json()["detail"].startswith("model 'gone' is unavailable: the files of gone:1 (target)")
    assert missing in rest.json()["detail"] and int(rest["Retry-After"]) > 0
    for response in (chat, completion):
        assert response.status_code == 503, response.content
        error = response.json()["error"]
        assert error["code"] == "model_unavailable" and error["param"] == "model"
        assert "model 'gone' is unavailable" in error["message"] and missing in error["message"]
    assert Session.objects.count() == 0
    other = api_client.post(REST, {"prompt": "def f():", "model": "tiny", "max_new_tokens": 4}, format="json")
    assert other.status_code == 202, other.content  # the other model is unaffected


@pytest.mark.django_db
def test_an_unreadable_tokenizer_is_a_503_too(api_client, tiny_model_dirs, tmp_path):
    target_dir, draft_dir = copy_pair(tiny_model_dirs, tmp_path)
    register_pair("broken", "1", target_dir, draft_dir)
    (target_dir / "tokenizer.json").write_text("{not json")

    rest = api_client.post(REST, {"prompt": "def f():", "model": "broken", "max_new_tokens": 4}, format="json")
    chat = api_client.post(CHAT, {"model": "broken", "messages": [{"role": "user", "content": "hi"}]}, format="json")

    assert rest.status_code == 503 and "its tokenizer in" in rest.json()["detail"], rest.content
    assert chat.status_code == 503 and "model 'broken' is unavailable" in chat.json()["error"]["message"]


@pytest.mark.django_db
def test_a_missing_draft_refuses_only_the_drafter_that_loads_it(api_client, tiny_model_dirs, tmp_path):
    target_dir, draft_dir = copy_pair(tiny_model_dirs, tmp_path)
    register_pair("nodraft", "1", target_dir, draft_dir)
    shutil.rmtree(draft_dir)
    body = {"prompt": "def f():", "model": "nodraft", "max_new_tokens": 4}

    drafted = api_client.post(REST, {**body, "drafter": "draft_model"}, format="json")
    ngram = api_client.post(REST, {**body, "drafter": "ngram"}, format="json")

    assert drafted.status_code == 503 and "nodraft:1 (draft)" in drafted.json()["detail"], drafted.content
    assert ngram.status_code == 202, ngram.content


@pytest.mark.django_db
def test_the_admin_shows_the_version_unavailable(admin_client, tiny_model, gone):
    page = admin_client.get("/admin/metadata/modelversion/").content.decode()
    assert f"unavailable: its directory {gone.directory} does not exist" in page
    assert page.count('data-available="true"') == 3  # tiny's target and draft, gone's draft
    detail = admin_client.get(f"/admin/metadata/modelversion/{gone.pk}/change/")
    assert detail.status_code == 200 and "unavailable: its directory" in detail.content.decode()


@pytest.mark.django_db
def test_the_metrics_mark_it_unavailable(tiny_model, gone):
    sample = sample_ops_metrics()

    assert {"model": "gone", "version": "1", "role": "target",
            "missing": f"its directory {gone.directory} does not exist"} in sample["model_files"]
    value = lambda name, role: REGISTRY.get_sample_value(  # noqa: E731
        "specops_model_files_available", {"model": name, "version": "1", "role": role})
    assert value("gone", "target") == 0
    assert value("gone", "draft") == 1 and value("tiny", "target") == 1


@pytest.mark.django_db
def test_the_quick_pair_replaces_an_active_demo_whose_files_are_missing(tiny_model_dirs, tmp_path):
    elsewhere_target, elsewhere_draft = copy_pair(tiny_model_dirs, tmp_path / "another-checkout")
    register_demo_pair("seed0", elsewhere_target, elsewhere_draft)  # the full pair, built elsewhere
    shutil.rmtree(tmp_path / "another-checkout")

    target, promoted = register_demo_pair("quick-0", *tiny_model_dirs)

    assert promoted and target.status == VersionStatus.ACTIVE
    assert ModelVersion.objects.get(name="demo", version="seed0", role="target").status == VersionStatus.RETIRED


@pytest.mark.django_db
def test_a_demo_version_registered_from_files_this_host_lacks_points_at_the_pair_just_built(
        tiny_model_dirs, tmp_path):
    elsewhere_target, elsewhere_draft = copy_pair(tiny_model_dirs, tmp_path / "another-checkout")
    register_demo_pair("quick-0", elsewhere_target, elsewhere_draft)
    shutil.rmtree(tmp_path / "another-checkout")

    target, _ = register_demo_pair("quick-0", *tiny_model_dirs)

    assert target.status == VersionStatus.ACTIVE and version_files.missing_files(target) is None
    assert version_files.missing_files(target.default_draft) is None
    assert target.directory.resolve() == tiny_model_dirs[0].resolve()


@pytest.mark.django_db
def test_the_quick_pair_still_never_demotes_a_full_pair_whose_files_are_there(tiny_model_dirs, tmp_path):
    register_demo_pair("seed0", *copy_pair(tiny_model_dirs, tmp_path))

    _, promoted = register_demo_pair("quick-0", *tiny_model_dirs)

    assert not promoted
    assert ModelVersion.objects.get(name="demo", role="target", status=VersionStatus.ACTIVE).version == "seed0"


@pytest.mark.django_db
def test_the_worker_preloads_the_versions_it_has_the_files_of(tiny_model, gone, caplog):
    from inference.worker.preload import preload_each

    models = preload_each([gone, tiny_model], "cpu")

    assert list(models) == [tiny_model.pk]
    assert f"not preloading gone:1 (target) on cpu: its files are missing or unreadable: its directory " \
           f"{gone.directory} does not exist" in caplog.text
