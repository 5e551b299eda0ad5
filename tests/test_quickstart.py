"""A first run serves at once: the quick demo pair, the background build's progress, the 503 check.

The quick preset is built once for the module with a shorter time budget than `make run`'s (the
same shape, corpus and phases); the "full" build here is the toy `DemoBuildConfig.quick()`,
interrupted and resumed. Every test has its own SPECOPS_MODEL_DIR and the tests' Redis db.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest
import redis
from django.conf import settings as django_settings
from django.core.management import call_command
from rest_framework.authtoken.models import Token

from sessions.submission import prediction_cache
from inference.demo import demo_build_progress
from inference.demo.builder import DemoBuildConfig, build_demo_models
from inference.demo.jobs import QUICK_SUBDIR, DemoJob, run_job
from inference.build_records import BUILDING, DONE, INTERRUPTED, KEY, build_record
from inference.demo.progress import BuildProgress
from inference.engine.lm.loading import load_causal_lm
from metadata.models import ModelRole, ModelVersion, VersionStatus
from metadata.api.tenancy import tenant_of
from inference.registry import (
    DEMO_NAME,
    full_version,
    pending_build,
    quick_version,
    register_demo_pair,
    register_pair,
    split_model_id,
)

# make run's preset with a 2 s budget instead of 15 s: the test checks the recipe, not the minute.
QUICK_FOR_TESTS = dataclasses.replace(DemoBuildConfig.starter(0), target_budget_s=2.0)
TOY_FULL = DemoBuildConfig.quick(0)  # 12 target steps, checkpoints every 5


@pytest.fixture
def redis_client():
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    client.delete(KEY)
    yield client
    client.delete(KEY)
    client.close()


@pytest.fixture
def model_dir(settings, tmp_path, tmp_path_factory):
    settings.SPECOPS_MODEL_DIR = tmp_path / "models"
    settings.SPECOPS_CACHE_DIR = tmp_path_factory.getbasetemp() / "specops-cache"  # tokenizers, shared
    return settings.SPECOPS_MODEL_DIR


@pytest.fixture(scope="module")
def quick_build(tmp_path_factory):
    """The quick pair's files, built once (seconds)."""
    root = tmp_path_factory.mktemp("quick")
    return build_demo_models(root, config=QUICK_FOR_TESTS, progress=False, threads=1,
                             cache_dir=tmp_path_factory.getbasetemp() / "specops-cache")


def quick_job(model_dir, quick_build) -> DemoJob:
    """The quick job over the module's build (copied in, so the job finds it finished)."""
    import shutil

    shutil.copytree(quick_build.target_dir.parent, model_dir / QUICK_SUBDIR)
    return DemoJob.quick(0, config=QUICK_FOR_TESTS)


def active_demo() -> ModelVersion | None:
    return ModelVersion.objects.filter(name=DEMO_NAME, role=ModelRole.TARGET, status=VersionStatus.ACTIVE).first()


def test_the_quick_preset_builds_in_seconds_and_writes_text(quick_build):
    metrics = quick_build.metrics
    assert metrics["build_seconds"] < 60
    assert set(metrics["phase_seconds"]) == {"tokenizer_and_data", "train_target", "target_greedy_text",
                                             "distil_draft", "save_and_evaluate"}
    assert metrics["phase_seconds"]["train_target"] < QUICK_FOR_TESTS.target_budget_s + 5
    target = load_causal_lm(quick_build.target_dir)
    ids = target.tokenizer("def main(", return_tensors="pt")["input_ids"]
    out = target.model.generate(ids, max_new_tokens=12, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 12
    # The starter config's extra fields change its hash; the default config's hash does not move.
    assert DemoBuildConfig.starter(0).digest() != DemoBuildConfig(seed=0).digest()
    assert DemoBuildConfig(seed=0).digest() == "e7f0ee87fb77dfdf"


def test_the_quick_pair_is_registered_and_promoted_at_once(db, model_dir, quick_build, redis_client,
                                                           django_capture_on_commit_callbacks, tmp_path,
                                                           monkeypatch):
    quick_job(model_dir, quick_build)
    monkeypatch.setattr(DemoBuildConfig, "starter", classmethod(lambda cls, seed=0: QUICK_FOR_TESTS))
    serving = tmp_path / "serving"
    with django_capture_on_commit_callbacks(execute=True):
        call_command("build_demo_models", "--quick", "--serving-file", str(serving), "--threads", "1")
    target = active_demo()
    assert target is not None and target.version == quick_version(0) == "quick-0"
    assert target.default_draft.status == VersionStatus.ACTIVE
    assert target.path == f"{QUICK_SUBDIR}/demo-target"
    assert serving.read_text().strip() == "demo:quick-0"
    record = build_record(DEMO_NAME, "quick-0")
    assert record["state"] == DONE and record["message"] == "promoted"
    assert demo_build_progress()["version"] == "quick-0"


def test_the_full_build_records_progress_resumes_and_replaces_the_quick_pair(
        db, model_dir, quick_build, redis_client, django_capture_on_commit_callbacks, tiny_model_dirs):
    with django_capture_on_commit_callbacks(execute=True):
        quick, _ = register_demo_pair(quick_version(0), *tiny_model_dirs)
    assert active_demo() == quick
    namespace = prediction_cache._namespace_key(quick.pk)
    before = int(redis_client.get(namespace) or 0)
    job = DemoJob(full_version(0), TOY_FULL, model_dir)

    class KilledAtStepSix(BuildProgress):
        def step_done(self, done: int) -> None:
            super().step_done(done)
            if self.record["phase"] == "train_target" and done == 6:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_job(job, progress=KilledAtStepSix(DEMO_NAME, job.version, stream=None), tqdm_bars=False)
    record = build_record(DEMO_NAME, "seed0")
    assert (record["state"], record["phase"], record["step"], record["total"]) == (INTERRUPTED, "train_target", 6, 12)
    assert pending_build("demo:seed0") is None  # a stopped build is not coming: no 503 for it
    assert active_demo() == quick

    seen: list[tuple[str, int]] = []

    class Watched(BuildProgress):
        def step_done(self, done: int) -> None:
            super().step_done(done)
            seen.append((self.record["phase"], done))

    with django_capture_on_commit_callbacks(execute=True):
        result = run_job(job, progress=Watched(DEMO_NAME, job.version, stream=None), tqdm_bars=False)
    assert seen[0] == ("tokenizer_and_data", 1) and ("train_target", 6) in seen
    assert not any(phase == "train_target" and step <= 5 for phase, step in seen)  # resumed at step 5
    record = build_record(DEMO_NAME, "seed0")
    assert record["state"] == DONE and record["resumed"] == [{"phase": "train_target", "step": 5}]
    assert result.promoted and active_demo() == result.target and result.target.version == "seed0"
    quick.refresh_from_db()
    assert quick.status == VersionStatus.RETIRED
    assert int(redis_client.get(namespace)) == before + 1  # the quick pair's cached predictions are orphaned
    assert pending_build("demo:seed0") is None and pending_build("demo") is None

    # A DSpark checkpoint beside the target (the full build's last phase writes one there) is
    # registered as the target's drafter when the job registers the pair.
    from inference.demo.dspark_phase import dspark_directory_for
    from inference.engine.lm.loading import load_causal_lm
    from tests.inference.engine.dspark_models import write_deepspec_checkpoint

    assert not result.target.dspark_path
    write_deepspec_checkpoint(dspark_directory_for(result.built.target_dir),
                              load_causal_lm(result.built.target_dir).model, target_layer_ids=(-1, 0))
    with django_capture_on_commit_callbacks(execute=True):
        again = run_job(job, progress=BuildProgress(DEMO_NAME, job.version, stream=None), tqdm_bars=False)
    assert again.target.pk == result.target.pk
    assert again.target.dspark_directory == dspark_directory_for(result.built.target_dir)


def test_pending_build_answers_for_a_version_still_building(db, redis_client, tiny_model_dirs):
    start = time.time() - 200  # a clock that moves a second per reading, ending about now
    clock = iter(start + t for t in range(1000)).__next__
    progress = BuildProgress(DEMO_NAME, "seed0", stream=None, clock=clock, write_every_s=0)
    progress.started()
    progress.phase_started("train_target", 500)
    for step in range(1, 11):
        progress.step_done(step)  # one step a second: 490 s left in the phase, more after it

    pending = pending_build("demo:seed0")
    assert pending["state"] == BUILDING and pending["model"] == "demo:seed0"
    assert (pending["phase"], pending["step"], pending["total"]) == ("train_target", 10, 500)
    assert pending["eta_s"] > 490 and pending["retry_after_s"] == 300
    assert "'demo:seed0' is still being built" in pending["message"]
    assert pending_build("demo", version="seed0")["model"] == "demo:seed0"
    # Nothing serves 'demo' yet: a request for the plain name waits for the build as well.
    assert pending_build("demo")["version"] == "seed0"
    assert pending_build("nope") is None and pending_build("demo:seed9") is None

    register_demo_pair(quick_version(0), *tiny_model_dirs)  # the quick pair serves 'demo' now
    assert pending_build("demo") is None
    assert pending_build("demo:seed0")["retry_after_s"] == 300  # the full pair is still on its way

    progress.finished(DONE, "promoted")
    assert pending_build("demo:seed0") is None


def test_a_build_whose_process_died_is_shown_interrupted(db, redis_client):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    progress = BuildProgress(DEMO_NAME, "seed0", stream=None)
    progress.record["pid"] = int(dead.stdout)
    progress.started()
    assert build_record(DEMO_NAME, "seed0")["state"] == INTERRUPTED
    assert pending_build("demo:seed0") is None
    shown = demo_build_progress()
    assert shown["state"] == INTERRUPTED and shown["line"].startswith("demo:seed0 interrupted")


def test_the_quick_pair_never_demotes_a_chosen_version(db, tiny_model_dirs):
    register_pair(DEMO_NAME, "custom", *tiny_model_dirs)  # an operator's version, active
    quick, promoted = register_demo_pair(quick_version(0), *tiny_model_dirs)
    assert not promoted and quick.status == VersionStatus.STAGED
    full, promoted = register_demo_pair(full_version(0), *tiny_model_dirs)
    assert not promoted and active_demo().version == "custom"


def test_progress_lines_for_the_terminal():
    lines = []

    class Terminal:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    clock = iter(float(t) for t in range(0, 1000, 20)).__next__
    progress = BuildProgress(DEMO_NAME, "seed0", stream=Terminal(), clock=clock, print_every_s=30,
                             client=redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.1))
    progress.started()
    progress.phase_started("train_target", 500)
    for step in range(1, 4):
        progress.step_done(step)
    progress.finished(INTERRUPTED, "stopped")
    assert lines[0] == "demo build demo:seed0 building: starting\n"
    assert any("train_target" in line and "min left" in line for line in lines)
    assert lines[-1] == "demo build demo:seed0 interrupted: stopped\n"  # Redis down: printed all the same


def test_model_ids_name_a_version():
    assert split_model_id("demo:seed0") == ("demo", "seed0")
    assert split_model_id("demo") == ("demo", None)
    assert split_model_id("demo:") == ("demo", None)


def test_prepare_run_migrates_creates_the_operator_and_writes_the_ready_file(db, settings, tmp_path):
    settings.STATIC_ROOT = tmp_path / "static"
    ready = tmp_path / "var" / "prepared"
    call_command("prepare_run", "--ready-file", str(ready), stdout=open(tmp_path / "out", "w"))
    assert ready.read_text() == "ready\n"
    printed = (tmp_path / "out").read_text()
    assert "password:" in printed and "API token:" in printed
    key = printed.split("API token:")[1].split()[0]
    user = Token.objects.select_related("user").get(key=key).user
    assert not (user.is_superuser or user.is_staff) and tenant_of(user) is not None  # a tenant's, not an admin's
    assert not Token.objects.filter(user__is_superuser=True).exists()  # the operator signs in; no token


def _building_full_pair() -> BuildProgress:
    progress = BuildProgress(DEMO_NAME, "seed0", stream=None, write_every_s=0)
    progress.started()
    progress.phase_started("train_target", 500)
    progress.step_done(3)
    return progress


def test_both_apis_answer_503_with_retry_after_while_the_demo_model_builds(db, api_client, redis_client,
                                                                          tiny_model_dirs):
    progress = _building_full_pair()
    rest = api_client.post("/api/v1/generations/", {"prompt": "def f():", "model": "demo"}, format="json")
    assert rest.status_code == 503 and 5 <= int(rest["Retry-After"]) <= 300
    assert "'demo' is still being built" in rest.json()["detail"]
    openai = api_client.post("/v1/completions", {"model": "demo", "prompt": "def f():"}, format="json")
    assert openai.status_code == 503 and openai["Retry-After"] == rest["Retry-After"]
    assert openai.json()["error"]["code"] == "model_building"
    assert api_client.get("/v1/models/demo").status_code == 503
    # Another name is not being built: an ordinary 404 / field error, no waiting.
    assert api_client.post("/v1/completions", {"model": "nope", "prompt": "x"},
                           format="json").status_code == 404
    assert api_client.post("/api/v1/generations/", {"prompt": "x", "model": "nope"},
                           format="json").status_code == 400
    # Once the quick pair serves 'demo', requests for it are accepted (the full pair still builds).
    register_demo_pair(quick_version(0), *tiny_model_dirs)
    assert api_client.post("/api/v1/generations/", {"prompt": "def f():", "model": "demo"},
                           format="json").status_code != 503
    progress.finished(DONE, "promoted")


def test_a_full_builds_progress_counts_its_dspark_phases(db, redis_client):
    """The DSpark drafter's phases (after the pair) are part of the build's percent and ETA: the
    admin showed 0 % through the last ten minutes of a full build before."""
    from inference.demo.progress import DSPARK_PHASES, PAIR_PHASES, build_phases

    assert build_phases(DemoBuildConfig(seed=0)) == PAIR_PHASES + DSPARK_PHASES
    assert build_phases(DemoBuildConfig.quick(0)) == PAIR_PHASES
    clock = iter(time.time() + t for t in range(1000)).__next__
    progress = BuildProgress(DEMO_NAME, "seed0", stream=None, write_every_s=0, clock=clock,
                             phases=PAIR_PHASES + DSPARK_PHASES)
    progress.started()
    progress.phase_started("distil_draft", 300)
    progress.step_done(300)
    pair_done = progress.record["percent"]
    assert 35 < pair_done < 50  # the pair is under half of a full build
    progress.phase_started("train_dspark", 700)
    for step in range(1, 351):
        progress.step_done(step)
    record = progress.record
    assert record["phase_index"] == 6 and record["phases"][-1] == "train_dspark"
    assert pair_done < record["percent"] < 100
    assert record["eta_s"] == record["phase_eta_s"] > 0  # the last phase: nothing after it
    assert "(phase 7/7)" in demo_build_progress()["line"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
SHORT_TURNS = ["Hi, who are you?", "Can you write a function?", "Make it parse a date.", "Add a docstring.",
               "Now handle errors.", "Rename it to parse_day.", "Add a test.", "Thanks, that is all."]
SHORT_REPLY = "Sure, here it is:\ndef parse(text):\n    return text.split()\n"


def test_the_quick_pair_takes_a_one_function_tool_call_and_an_eight_turn_chat(db, api_client, quick_build):
    from transformers import AutoTokenizer

    from inference.api.openai.chat_template import render_chat

    register_demo_pair(quick_version(0), quick_build.target_dir, quick_build.draft_dir)
    tokenizer = AutoTokenizer.from_pretrained(quick_build.target_dir, local_files_only=True)
    chat = [message for turn in SHORT_TURNS for message in
            ({"role": "user", "content": turn}, {"role": "assistant", "content": SHORT_REPLY})][:-1]
    prompts = {"tool call": render_chat(tokenizer, [{"role": "user", "content": "Weather in Paris?"}], [WEATHER]),
               "8-turn chat": render_chat(tokenizer, chat)}
    for what, prompt in prompts.items():
        response = api_client.post("/api/v1/generations/", {"model": DEMO_NAME, "prompt": prompt, "max_new_tokens": 64},
                                   format="json")
        assert response.status_code == 202, (what, response.content)
