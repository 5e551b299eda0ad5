"""The compiled forward path: whole-model AOTInductor packages, built in the background, lossless.

One module fixture serves a tiny Llama pair while its packages are built by builder processes
(the way a worker does), so the switch from the eager forward to the compiled one happens under
a running generation; the other tests use the packages it left. Compiling costs a minute or two
of the machine, once per module.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from inference.engine import DraftConfig, GenerationConfig
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.batch.runners import CompileSettings
from inference.engine.decode.target_only import generate_plain
from inference.engine.runner.artifacts import GraphSpec, artifact_name, dynamic_shapes, example_inputs
from inference.engine.runner.static_forward import LOGITS_ALL, LOGITS_LAST, StaticForward

from inference.engine.lm.loading import LoadedModel

from .conftest import CONTEXT, VOCAB_SIZE, noisy_copy, target_model
from .family_models import shared_tokenizer

BUILD_TIMEOUT_S = 900
MAX_ROWS = 3


def _decode(tokens: list[int]) -> str:
    return "".join(f"<{token}>" for token in tokens)


def _windowed() -> torch.nn.Module:
    config = MistralConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           sliding_window=6)
    return MistralForCausalLM._from_config(config, attn_implementation="sdpa").to(torch.float64).eval()


# llama is not among them: the module fixture below builds both of its packages (an export with
# these Dims, which raises when a graph breaks or a declared dynamic size specialises), and its
# tests fail unless they served compiled at several rows, new-token counts and cache widths.
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral-window"])
@pytest.mark.parametrize("kind", [LOGITS_ALL, LOGITS_LAST])
def test_every_static_family_exports_whole_without_a_graph_break(family, kind):
    """`torch.export` has no fallback: a graph break, or Python deciding from a tensor's value,
    fails here before any worker meets it. Every size is a symbol in the exported graph."""
    model = _windowed() if family == "mistral-window" else target_model(family)
    spec = GraphSpec(kind, (-1, 0) if kind == LOGITS_ALL else (), capacity=192, max_tokens=64)
    forward = StaticForward(model, spec.kind, spec.taps)
    with torch.inference_mode():
        exported = torch.export.export(forward, example_inputs(model, spec),
                                       dynamic_shapes=dynamic_shapes(spec, forward.windowed), strict=False)
    symbols = {str(symbol) for symbol in exported.range_constraints}
    assert len(symbols) == 3, f"rows, new tokens and cached slots stay symbols: {exported.range_constraints}"


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("compiled-pair")
    target_model("llama").save_pretrained(root / "target")
    noisy_copy("llama").save_pretrained(root / "draft")
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("compiled-store")


def _engine(store: Path, target_dir: Path | None = None, draft_dir: Path | None = None, background: bool = False,
            max_rows: int = MAX_ROWS) -> BatchedSpeculativeEngine:
    """The tiny pair's engine; with directories, as loaded models a builder process can load again."""
    target, draft = target_model("llama"), noisy_copy("llama")
    if target_dir is not None:
        tokenizer = shared_tokenizer()  # one object for both: the pair's tokenizer check passes
        target = LoadedModel(target, tokenizer, CONTEXT, target_dir)
        draft = LoadedModel(draft, tokenizer, CONTEXT, draft_dir)
    return BatchedSpeculativeEngine(target, draft, decode=_decode, max_rows=max_rows,
                                    # builds at the suite's own priority: the tests wait for them
                                    compile=CompileSettings(mode="auto", store=store, background=background,
                                                            build_niceness=0))


@pytest.fixture(scope="module")
def switch(pair_dirs, store) -> dict:
    """A generation served while builder processes compile its pair: what each forward ran on."""
    engine = _engine(store, *pair_dirs, background=True)
    runners = engine.runners.all()
    assert all(runner._builds for runner in runners), "missing packages start builder processes"
    prompt = list(range(3, 20))
    config = GenerationConfig(max_new_tokens=120, eos_token_id=None)
    paths, tokens = [], []
    engine.submit(BatchRequest("switch", prompt, config, "draft_model", DraftConfig(length=3)))

    def step() -> None:
        for event in engine.step():
            tokens.extend(event.step.token_ids)
        paths.append(engine.runners.target.last_path)

    for _ in range(3):  # served eagerly while the packages build
        step()
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while any(runner._builds for runner in runners) and time.monotonic() < deadline:
        time.sleep(1.0)
        for runner in runners:
            runner._next_poll = 0.0
            runner.poll()
    while engine.has_work():
        step()
    return {"engine": engine, "paths": paths, "tokens": tokens, "prompt": prompt, "config": config}


def test_a_background_build_switches_a_running_generation_to_the_compiled_forward(switch):
    paths = switch["paths"]
    assert paths[0] == "eager" and paths[-1] == "compiled", paths
    first_compiled = paths.index("compiled")
    assert all(path == "compiled" for path in paths[first_compiled:])
    target = target_model("llama")
    assert switch["tokens"] == generate_plain(target, switch["prompt"], switch["config"], decode=_decode).token_ids
    stats = switch["engine"].runners.target.stats
    assert stats.cache_misses == 2 and stats.compile_seconds > 0 and not stats.fallback


def test_compiled_rows_equal_the_compiled_targets_own_greedy_output_in_any_batch(switch, store):
    engine = _engine(store)
    assert engine.runners.target.ready(LOGITS_ALL) and engine.runners.target.ready(LOGITS_LAST)
    requests = [BatchRequest(index, [5 + index, 17, 33, 2 + 3 * index][: 2 + index % 3],
                             GenerationConfig(max_new_tokens=10 + 3 * index, eos_token_id=None), kind,
                             DraftConfig(length=1 + index % 4))
                for index, kind in enumerate(["draft_model", "ngram", "tree", "none", "suffix", "draft_model"])]
    results = engine.run(requests, {index: index % 3 for index in range(len(requests))})
    alone = _engine(store, max_rows=1)
    for request in requests:
        plain = BatchRequest(request.request_id, request.prompt_ids, request.config, "none")
        expected = alone.run([plain])[request.request_id].token_ids
        assert results[request.request_id].token_ids == expected, request.drafter
    assert engine.runners.target.stats.forwards["compiled"] > 0 and engine.runners.draft.stats.forwards["compiled"] > 0


def test_a_seeded_sampled_row_gives_the_same_tokens_alone_and_in_a_compiled_batch(switch, store):
    config = GenerationConfig(max_new_tokens=24, temperature=1.0, seed=7, eos_token_id=None)
    sampled = BatchRequest("s", [9, 8, 7, 6], config, "draft_model", DraftConfig(length=3))
    others = [BatchRequest(index, [3 + index, 4], GenerationConfig(max_new_tokens=20, eos_token_id=None), "tree")
              for index in range(2)]
    alone = _engine(store).run([sampled])["s"].token_ids
    assert _engine(store).run([*others, sampled])["s"].token_ids == alone


def test_a_restarted_engine_loads_the_packages_and_runs_compiled_from_its_first_forward(switch, store):
    engine = _engine(store)
    for runner in engine.runners.all():
        assert runner.stats.cache_hits == 2 and runner.stats.cache_misses == 0 and not runner._builds
    engine.run([BatchRequest(0, [4, 5, 6], GenerationConfig(max_new_tokens=4, eos_token_id=None), "none")])
    assert engine.runners.target.stats.forwards == {"compiled": engine.runners.target.stats.forwards["compiled"],
                                                    "eager": 0}


def test_a_package_that_does_not_load_leaves_the_model_eager_with_a_reason(switch, store, tmp_path, caplog):
    broken = tmp_path / "store"
    broken.mkdir()
    runner_spec = GraphSpec(LOGITS_ALL, (), switch["engine"].runners.target.capacity,
                            switch["engine"].runners.target.max_tokens)
    (broken / artifact_name(target_model("llama"), runner_spec)).write_bytes(b"not a package")
    engine = _engine(broken)
    target_runner = engine.runners.target
    assert "failed" in target_runner.stats.fallback
    request = BatchRequest(0, [4, 5, 6], GenerationConfig(max_new_tokens=8, eos_token_id=None), "draft_model")
    tokens = engine.run([request])[0].token_ids
    assert tokens == generate_plain(target_model("llama"), [4, 5, 6], request.config, decode=_decode).token_ids
    assert target_runner.stats.forwards["compiled"] == 0 and target_runner.stats.forwards["eager"] > 0
    assert any("serves eagerly" in record.getMessage() for record in caplog.records)
