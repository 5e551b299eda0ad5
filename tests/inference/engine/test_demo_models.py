"""The demo build: corpus split, phases, determinism, resume/reuse, prompts, CLI.

Every build here uses `DemoBuildConfig.quick()`: the same phases and files as the real build, on
toy sizes, so each build takes seconds.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest
import torch

from inference.demo import builder as demo_models
from inference.demo import corpus
from inference.demo.builder import (
    DemoBuildConfig,
    build_demo_models,
    copy_matching_weights,
    main,
)
from inference.demo.prompts import load_heldout_prompts
from inference.demo.tokenizer_builder import train_tokenizer
from inference.demo.training import (
    OptimConfig,
    batch_at,
    greedy_acceptance,
    simulate_chain,
    train_language_model,
)
from inference.engine.lm.loading import load_causal_lm, load_model_pair
from inference.demo.tiny_models import (
    TINY_DRAFT,
    TINY_TARGET,
    causal_lm_config,
    random_causal_lm,
)

QUICK = DemoBuildConfig.quick(seed=0)
# Every build here trains on one thread (threads=1; the CLI's through `one_thread_builds`): a
# quick build took 1.7 CPU-s and 3 s on one thread, 5.7 CPU-s and 14 s on the two cores of a
# busy machine, whose second thread mostly waits. Builds compared weight for weight use the same.


def weights(directory) -> dict[str, torch.Tensor]:
    return load_causal_lm(directory).model.state_dict()


def same_weights(first, second) -> bool:
    one, two = weights(first), weights(second)
    return one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


@pytest.fixture
def one_thread_builds(monkeypatch):
    """The CLI's builds (which use every core) on one thread; the build itself is the real one."""
    monkeypatch.setattr(demo_models, "build_demo_models",
                        functools.partial(demo_models.build_demo_models, threads=1))


@pytest.fixture(scope="module")
def quick_build(tmp_path_factory):
    return build_demo_models(tmp_path_factory.mktemp("demo"), config=QUICK, progress=False, threads=1)


# --- corpus -----------------------------------------------------------------------------------


def test_corpus_is_the_sorted_stdlib_without_tests_or_third_party_code():
    files = corpus.stdlib_source_files()
    names = [source.relative for source in files]
    assert names == sorted(names)
    assert "json/decoder.py" in names and "os.py" in names
    assert not any(part in corpus.EXCLUDED_DIRS for name in names for part in name.split("/")[:-1])
    assert all(source.path.suffix == ".py" for source in files)


def test_heldout_split_is_disjoint_deterministic_and_about_the_asked_size():
    files = corpus.stdlib_source_files()
    train, heldout = corpus.split_heldout(files, fraction=0.05)
    assert {s.relative for s in train}.isdisjoint({s.relative for s in heldout})
    assert len(train) + len(heldout) == len(files)
    assert 0.02 < len(heldout) / len(files) < 0.09
    assert corpus.split_heldout(files, fraction=0.05) == (train, heldout)
    with pytest.raises(ValueError, match="fraction"):
        corpus.split_heldout(files, fraction=1.5)


def test_missing_stdlib_directory_is_a_corpus_error(tmp_path):
    with pytest.raises(corpus.CorpusError, match="does not exist"):
        corpus.stdlib_source_files(tmp_path / "nowhere")


# --- training loops ---------------------------------------------------------------------------


def test_batches_are_a_pure_function_of_seed_and_step():
    stream = torch.arange(10_000, dtype=torch.int32)
    batch = batch_at(stream, step=3, batch_size=4, seq_len=16, seed=1)
    assert batch.shape == (4, 17)
    assert torch.equal(batch[:, 1:], batch[:, :-1] + 1)  # contiguous windows
    assert torch.equal(batch, batch_at(stream, step=3, batch_size=4, seq_len=16, seed=1))
    assert not torch.equal(batch, batch_at(stream, step=4, batch_size=4, seq_len=16, seed=1))


def test_interrupted_training_resumes_to_the_same_weights(tmp_path):
    tokenizer = train_tokenizer(corpus.sample_texts(20_000), vocab_size=300)
    stream = torch.randint(0, 300, (5_000,), generator=torch.Generator().manual_seed(0))
    optim = OptimConfig(steps=9, batch_size=2, seq_len=16, lr=1e-2, warmup_steps=1,
                        checkpoint_every=4)

    def fresh():
        return random_causal_lm(causal_lm_config("llama", TINY_DRAFT, tokenizer), seed=0)

    straight = fresh()
    train_language_model(straight, stream, optim, seed=0, checkpoint=tmp_path / "a.ckpt")

    def crash_at_six(step):
        if step == 6:
            raise KeyboardInterrupt

    interrupted = fresh()
    with pytest.raises(KeyboardInterrupt):
        train_language_model(interrupted, stream, optim, seed=0, checkpoint=tmp_path / "b.ckpt",
                             on_step=crash_at_six)
    assert torch.load(tmp_path / "b.ckpt", weights_only=True)["step"] == 4
    resumed = fresh()
    steps_run = []
    train_language_model(resumed, stream, optim, seed=0, checkpoint=tmp_path / "b.ckpt",
                         on_step=steps_run.append)
    assert steps_run == [5, 6, 7, 8, 9]
    for name, tensor in straight.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
    assert not torch.equal(straight.state_dict()["lm_head.weight"],
                           fresh().state_dict()["lm_head.weight"])


def test_draft_starts_from_the_target_s_embeddings_and_first_layer():
    tokenizer = train_tokenizer(corpus.sample_texts(20_000), vocab_size=300)
    target = random_causal_lm(causal_lm_config("llama", TINY_TARGET, tokenizer), seed=0)
    draft_shape = replace(TINY_TARGET, layers=1)
    draft = random_causal_lm(causal_lm_config("llama", draft_shape, tokenizer), seed=1)
    copied = copy_matching_weights(target, draft)
    assert "model.embed_tokens.weight" in copied and "model.norm.weight" in copied
    assert not any(name.startswith("model.layers.1.") for name in copied)
    target_state, draft_state = target.state_dict(), draft.state_dict()
    for name in draft_state:
        assert torch.equal(draft_state[name], target_state[name]), name
    # A narrower draft shares no shapes with the target, so nothing is copied.
    narrow = random_causal_lm(causal_lm_config("llama", TINY_DRAFT, tokenizer), seed=1)
    assert copy_matching_weights(target, narrow) == []


def test_chain_simulation_counts_leading_hits_and_the_target_token():
    hits = [True, True, False, True, True, True, True, True, False]
    # step 1 drafts 4 (accepts 2, target corrects position 2); step 2 accepts all 4 (bonus at 7);
    # step 3 drafts the last position and misses.
    assert simulate_chain(hits, draft_length=4) == (9, 6, 3)
    assert simulate_chain([], draft_length=4) == (0, 0, 0)
    assert simulate_chain([True] * 10, draft_length=4) == (8, 8, 2)


def test_a_draft_equal_to_the_target_is_always_accepted(quick_build):
    target = load_causal_lm(quick_build.target_dir)
    prompts = [torch.tensor(target.tokenizer(text)["input_ids"])
               for text in load_heldout_prompts(quick_build.heldout_prompts_path)]
    same = greedy_acceptance(target.model, target.model, prompts, new_tokens=10, draft_length=4)
    assert same == {"token_match": 1.0, "acceptance": 1.0, "mean_accepted_length": 5.0}


# --- the build --------------------------------------------------------------------------------


def test_quick_build_writes_a_loadable_pair_and_heldout_prompts(quick_build):
    target, draft = load_model_pair(quick_build.target_dir, quick_build.draft_dir)
    assert target.model.config.model_type == draft.model.config.model_type == "llama"
    assert target.model.config.num_hidden_layers == QUICK.target.layers
    assert draft.model.config.num_hidden_layers == QUICK.draft.layers
    assert target.context_length == QUICK.context_length
    assert len(target.tokenizer) == QUICK.vocab_size

    document = json.loads(quick_build.heldout_prompts_path.read_text())
    texts = load_heldout_prompts(quick_build.heldout_prompts_path)
    assert len(texts) == QUICK.prompt_count == len({t for t in texts})
    train, heldout = corpus.split_heldout(corpus.stdlib_source_files(), QUICK.heldout_fraction)
    heldout_names = {source.relative for source in heldout}
    for entry in document["prompts"]:
        assert entry["source"] in heldout_names
        assert entry["text"].lstrip().startswith(("def ", "async def "))
        assert 0 < len(target.tokenizer(entry["text"])["input_ids"]) <= QUICK.prompt_tokens + 2

    metrics = quick_build.metrics
    for key in ("acceptance", "token_match"):
        assert 0.0 <= metrics[key] <= 1.0
    assert 1.0 <= metrics["mean_accepted_length"] <= 5.0
    assert metrics["draft_parameters"] < metrics["target_parameters"]
    assert metrics["draft_forward_ms"] > 0 and metrics["target_forward_ms"] > 0
    marker = json.loads((quick_build.target_dir.parent / "build.json").read_text())
    assert marker["config_hash"] == QUICK.digest()
    assert not (quick_build.target_dir.parent / ".build").exists()


def test_finished_build_is_reused_and_a_new_config_rebuilds(tmp_path, monkeypatch):
    first = build_demo_models(tmp_path, config=QUICK, progress=False, threads=1)
    mtime = (first.target_dir / "model.safetensors").stat().st_mtime_ns

    def must_not_train(*args, **kwargs):
        raise AssertionError("a finished build must not train again")

    with monkeypatch.context() as patch:
        patch.setattr(demo_models, "train_language_model", must_not_train)
        again = build_demo_models(tmp_path, config=QUICK, progress=False, threads=1)
    assert again.metrics == first.metrics
    assert (first.target_dir / "model.safetensors").stat().st_mtime_ns == mtime

    before = weights(first.target_dir)
    build_demo_models(tmp_path, config=replace(QUICK, seed=1), progress=False, threads=1)
    marker = json.loads((tmp_path / "build.json").read_text())
    assert marker["config_hash"] == replace(QUICK, seed=1).digest() != QUICK.digest()
    after = weights(first.target_dir)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_build_is_deterministic_and_an_interrupted_build_resumes(
    tmp_path, monkeypatch, quick_build
):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(demo_models, "distil_draft", interrupted)
        with pytest.raises(KeyboardInterrupt):
            build_demo_models(tmp_path, config=QUICK, progress=False, threads=1)
    assert not (tmp_path / "build.json").exists()
    assert (tmp_path / ".build" / "target" / "config.json").is_file()

    trained = []
    real_train = demo_models.train_language_model
    monkeypatch.setattr(demo_models, "train_language_model",
                        lambda *a, **k: trained.append(1) or real_train(*a, **k))
    resumed = build_demo_models(tmp_path, config=QUICK, progress=False, threads=1)
    assert trained == []  # the target phase was finished and is not redone
    assert same_weights(resumed.target_dir, quick_build.target_dir)
    assert same_weights(resumed.draft_dir, quick_build.draft_dir)
    assert resumed.heldout_prompts_path.read_text() == quick_build.heldout_prompts_path.read_text()


def test_a_build_with_a_cache_dir_keeps_its_tokenizer_there_and_builds_the_same_pair(
    tmp_path, quick_build
):
    cache = tmp_path / "cache"
    cached = build_demo_models(tmp_path / "demo", config=QUICK, progress=False, threads=1, cache_dir=cache)
    assert len(list((cache / "tokenizers").glob(f"stdlib-bpe-{QUICK.vocab_size}-*/tokenizer.json"))) == 1
    target, reference = load_causal_lm(cached.target_dir), load_causal_lm(quick_build.target_dir)
    assert target.tokenizer.get_vocab() == reference.tokenizer.get_vocab()
    assert target.tokenizer.model_max_length == QUICK.context_length
    assert same_weights(cached.target_dir, quick_build.target_dir)


def test_cli_builds_and_reports_errors_in_one_line(tmp_path, capsys, one_thread_builds):
    assert main(["--out", str(tmp_path / "demo"), "--quick", "--no-progress"]) == 0
    assert "acceptance" in capsys.readouterr().out
    (tmp_path / "a-file").write_text("")
    assert main(["--out", str(tmp_path / "a-file"), "--quick", "--no-progress"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "a-file" in error and error.count("\n") == 1


@pytest.mark.parametrize("flags, named", [
    (["--device", "tpu"], "--device"),
    (["--dspark-budget-s", "0"], "--dspark-budget-s"),
    (["--dspark-sequences", "1"], "--dspark-sequences"),
])
def test_cli_refuses_a_bad_device_or_dspark_override_in_one_line_and_builds_nothing(tmp_path, capsys, flags, named):
    out = tmp_path / "demo"
    assert main(["--out", str(out), "--no-progress", *flags]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and named in error and error.count("\n") == 1
    assert not out.exists()


def test_cli_refuses_cuda_where_there_is_none(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    assert main(["--out", str(tmp_path / "demo"), "--quick", "--no-progress", "--device", "cuda"]) == 1
    assert "no CUDA device" in capsys.readouterr().err


def test_dspark_overrides_change_the_dspark_build_and_only_it():
    from inference.demo.builder import _with_dspark_overrides
    base = DemoBuildConfig()
    changed = _with_dspark_overrides(base, 90.0, 512)
    assert (changed.dspark.budget_s, changed.dspark.sequences) == (90.0, 512)
    assert changed.dspark.digest() != base.dspark.digest()
    assert changed.target == base.target and changed.draft_optim == base.draft_optim
    assert _with_dspark_overrides(base, None, None) is base
