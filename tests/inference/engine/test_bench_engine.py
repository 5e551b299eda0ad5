"""bench/engine.py runs end to end on a tiny pair and ends with the machine-readable RESULT line."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from inference.engine import DraftConfig, GenerationConfig, GenerationStats, build_drafter
from inference.demo.tiny_models import build_tiny_pair
from tests.paths import REPO_ROOT

BENCH = REPO_ROOT / "bench" / "engine.py"
# the served engine's eager path: its compiled one builds packages for minutes, and is tested in
# test_compiled_forward.py on the same engine; here the bench's own bookkeeping is under test
EAGER_ENGINE = ("--engine-compile", "off")
RESULT = re.compile(r"^RESULT greedy_identical=(true|false) speedup_vs_baseline=[\d.]+ "
                    r"speedup_vs_hf_assisted=[\d.]+ single_decoder_vs_hf_assisted=[\d.]+ tree_over_chain_accept_len=[\d.]+ "
                    r"acceptance=[\d.]+"
                    r"( tree_over_chain_accept_len_t1=[\d.]+ tree_over_chain_tok_s_t1=[\d.]+)?"
                    r"( tree_over_chain_accept_len_weak_t1=[\d.]+)?"
                    r"( dspark_tau_over_chain=[\d.]+ dspark_tau_over_chain_t1=[\d.]+)?$")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_engine", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bench-models")
    target, draft = build_tiny_pair(root / "built", arch="llama")
    (root / "demo-target").symlink_to(target)
    (root / "demo-draft").symlink_to(draft)
    prompts = ["def main():\n    return 0\n", "import os\n\nclass Config:\n    def load(self):"]
    (root / "heldout_prompts.json").write_text(json.dumps(
        {"version": 1, "prompts": [{"id": i, "text": text} for i, text in enumerate(prompts)]}))
    return root


def test_bench_prints_a_result_line_and_identical_greedy_outputs(bench, tiny_model_dir, capsys):
    assert bench.main(["--model-dir", str(tiny_model_dir), "--prompts", "2", "--repeats", "1",
                       "--max-new-tokens", "12", "--threads", "1", *EAGER_ENGINE]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert RESULT.match(lines[-1]), lines[-1]
    assert "greedy_identical=true" in lines[-1]
    assert any(line.startswith("hf_assisted") for line in lines)
    # the speedups time the served engine at batch 1; the one-at-a-time decoder is printed beside it
    assert any(line.startswith("ours_engine_draft_model") for line in lines)
    assert any(line.startswith("ours_draft_model ") for line in lines)


def test_bench_compares_dspark_with_the_chain_at_its_block_when_the_target_has_one(bench, tiny_model_dir,
                                                                                    tmp_path, capsys):
    from inference.engine.lm.loading import load_causal_lm
    from tests.inference.engine.dspark_models import write_deepspec_checkpoint

    target = load_causal_lm(tiny_model_dir / "demo-target").model
    checkpoint = write_deepspec_checkpoint(tmp_path / "dspark", target, target_layer_ids=(-1, 0), block_size=3)
    assert bench.main(["--model-dir", str(tiny_model_dir), "--prompts", "2", "--repeats", "1",
                       "--max-new-tokens", "10", "--threads", "1", "--temperatures", "0", "--budgets", "8",
                       "--weak-steps", "0", "--dspark", str(checkpoint), *EAGER_ENGINE]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert RESULT.match(lines[-1]), lines[-1]
    assert "greedy_identical=true" in lines[-1] and " dspark_tau_over_chain_t1=" in lines[-1]
    assert any(line.startswith("dspark_greedy") for line in lines)


def test_bench_measures_tree_against_chain_on_a_weak_draft_it_builds(bench, tiny_model_dir, capsys):
    args = ["--model-dir", str(tiny_model_dir), "--prompts", "2", "--repeats", "1",
            "--max-new-tokens", "12", "--threads", "1", "--budgets", "4,16", "--node-budget", "4",
            "--temperatures", "0,1",
            "--weak-steps", "2", "--weak-corpus-chars", "20000", *EAGER_ENGINE]
    assert bench.main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert RESULT.match(lines[-1]), lines[-1]
    assert "greedy_identical=true" in lines[-1]  # the weak pair's greedy runs included
    assert "tree_over_chain_accept_len_weak_t1=" in lines[-1]
    assert any(line.startswith("weak_tree16_t1") for line in lines)
    built = tiny_model_dir / "weak-draft-s2"
    assert (built / "config.json").is_file()
    stamp = (built / "config.json").stat().st_mtime_ns
    assert bench.main(args) == 0  # cached: the second run reuses it
    assert (built / "config.json").stat().st_mtime_ns == stamp


def test_expected_tokens_per_step_bound(bench):
    assert bench.expected_tokens_per_step(0.0, 4) == 1.0
    assert bench.expected_tokens_per_step(1.0, 4) == 5.0
    assert bench.expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)


def _counting_runner(seen: list[int]):
    def run(prompt: list[int], index: int = 0):
        seen.append(index)
        return [1, 2], GenerationStats(steps=1, new_tokens=2)
    return run


def test_sampled_methods_add_every_pass_and_greedy_ones_keep_the_last(bench):
    prompts = [[1], [2], [3]]
    sampled_seen: list[int] = []
    sampled = bench.Method("sampled", _counting_runner(sampled_seen), greedy=False)
    greedy = bench.Method("greedy", _counting_runner([]))
    for index in range(3):
        sampled.measure(prompts, lambda: None, index)
        greedy.measure(prompts, lambda: None, index)
    assert sampled.stats.steps == 9  # three passes of three prompts, each a new draw
    assert greedy.stats.steps == 3  # identical passes: the last one's counters
    assert sampled_seen == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len(sampled.tokens_per_second) == 3


def test_a_sampled_run_draws_new_seeds_each_pass_and_repeats_a_pass(bench, tiny_model_dir):
    args = bench.parse_args(["--model-dir", str(tiny_model_dir)])
    target, draft, tokenizer = bench.load_pair(args)
    drafter = build_drafter("draft_model", target=target, draft=draft, config=DraftConfig(length=3))
    run = bench.ours_runner(target, drafter, GenerationConfig(max_new_tokens=24, temperature=1.0))
    prompt = tokenizer("def main():", add_special_tokens=False)["input_ids"]
    first, _ = run(prompt, 0)
    assert run(prompt, 0)[0] == first  # the same pass draws the same tokens
    assert run(prompt, 1)[0] != first  # the next pass draws others
