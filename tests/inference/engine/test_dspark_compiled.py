"""DSpark's compiled greedy block (drafters/dspark/compiled.py): built in a process of its own,
drafting what the eager block drafts, and lossless under the batched engine.

One module fixture builds the tiny checkpoint's package the way a worker does (a builder process,
`python -m inference.engine.drafters.dspark.compiled`); the other tests load it from the store.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from inference.engine import DraftConfig, GenerationConfig
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.batch.runners import CompileSettings
from inference.engine.decode.sampling import SamplingParams
from inference.engine.decode.target_only import generate_plain
from inference.engine.drafters.base import DraftRequest
from inference.engine.drafters.dspark import DSparkDrafter, load_dspark
from inference.engine.drafters.dspark.batched import propose_blocks
from inference.engine.drafters.dspark.compiled import KIND, BlockRunner, package_name
from inference.engine.lm.modeling import context_length, logits_width

from .conftest import VOCAB_SIZE
from .dspark_models import qwen3_target, write_deepspec_checkpoint

BUILD_TIMEOUT_S = 600


def _decode(tokens: list[int]) -> str:
    return "".join(f"<{token}>" for token in tokens)


@pytest.fixture(scope="module")
def target():
    return qwen3_target(vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def dspark(target, tmp_path_factory):
    directory = tmp_path_factory.mktemp("dspark-compiled") / "checkpoint"
    # a confident head, so the scheduler admits this random drafter's blocks and they are verified
    return load_dspark(write_deepspec_checkpoint(directory, target, target_layer_ids=(0, 1), block_size=4,
                                                 confidence_bias=4.0), target)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dspark-store")


def _runner(target, dspark, store, background: bool = False) -> BlockRunner:
    return BlockRunner(dspark, logits_width(target), context_length(target), store, background, build_niceness=0)


@pytest.fixture(scope="module")
def built(target, dspark, store) -> BlockRunner:
    """The block built by a builder process, as a worker's engine has it built."""
    runner = _runner(target, dspark, store, background=True)
    runner.start()
    assert runner.stats.building == (KIND,), "a missing package starts a builder process"
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while runner.stats.building and time.monotonic() < deadline:
        time.sleep(0.5)
        runner._next_poll = 0.0
        runner.poll()
    return runner


def test_the_block_is_built_in_a_process_of_its_own_and_loaded(built, store):
    assert built.ready and not built.stats.fallback, built.stats.fallback
    assert built.stats.cache_misses == 1 and built.stats.compile_seconds > 0
    assert (store / package_name(built.model, built.spec)).exists()


def test_a_second_runner_loads_the_built_block_without_building(built, target, dspark, store):
    runner = _runner(target, dspark, store)
    runner.start()
    assert runner.ready and runner.stats.cache_hits == 1 and runner.stats.cache_misses == 0


def _drafters(dspark, lengths: list[int], threshold: float = 0.0) -> tuple[list[DSparkDrafter], list[list[int]]]:
    generator = torch.Generator().manual_seed(11)
    drafters, contexts = [], []
    for length in lengths:
        drafter = DSparkDrafter(dspark, VOCAB_SIZE, DraftConfig(confidence_threshold=threshold))
        drafter.observe_target_features(torch.randn(1, length, dspark.dspark.feature_width, generator=generator,
                                                    dtype=dspark.fc.weight.dtype))
        drafters.append(drafter)
        contexts.append([(7 * position + length) % (VOCAB_SIZE - 2) + 2 for position in range(length + 1)])
    return drafters, contexts


@pytest.mark.parametrize("lengths", [[9], [3, 17, 8]])
@pytest.mark.parametrize("threshold", [0.0, 0.985])
def test_compiled_blocks_draft_the_eager_blocks_tokens(built, dspark, lengths, threshold):
    drafters, contexts = _drafters(dspark, lengths, threshold)
    requests = [DraftRequest(depth, None, None) for depth in (4, 2, 3)[:len(lengths)]]
    eager = propose_blocks(drafters, contexts, requests)
    before = built.stats.forwards["compiled"]
    compiled = propose_blocks(drafters, contexts, requests, built)
    assert built.stats.forwards["compiled"] == before + 1  # every row in one compiled call
    for got, expected in zip(compiled, eager):
        assert got.token_ids == expected.token_ids and got.parent_ids == expected.parent_ids
        assert got.log_probs == pytest.approx(expected.log_probs, rel=1e-5)  # float32 log-softmax
        assert got.survival == pytest.approx(expected.survival, rel=1e-6)
    if threshold:  # the cut at the confidence threshold is the eager block's
        assert [len(tree.token_ids) for tree in compiled] == [len(tree.token_ids) for tree in eager]


def test_sampled_rows_draft_eagerly_beside_compiled_greedy_rows(built, dspark):
    drafters, contexts = _drafters(dspark, [5, 6])
    generator = torch.Generator().manual_seed(3)
    sampled = DraftRequest(4, SamplingParams(temperature=1.0), generator)
    before = dict(built.stats.forwards)
    trees = propose_blocks(drafters, contexts, [DraftRequest(4, None, None), sampled], built)
    assert built.stats.forwards["compiled"] == before["compiled"] + 1
    assert built.stats.forwards["eager"] == before["eager"] + 1
    assert trees[1].draft_probs is not None and len(trees[1].token_ids) == 4  # q rows for the rejection rule


def test_greedy_dspark_rows_equal_the_targets_own_greedy_output_with_the_compiled_block(built, target, dspark,
                                                                                      store):
    engine = BatchedSpeculativeEngine(target, None, decode=_decode, dspark=dspark, max_rows=3,
                                      compile=CompileSettings(mode="auto", store=store, background=False))
    assert engine.runners.dspark is not None and engine.runners.dspark.ready
    requests = [BatchRequest(index, [3 + index, 9, 14, 5 + 2 * index][: 2 + index % 3],
                             GenerationConfig(max_new_tokens=12 + 3 * index, eos_token_id=None), kind,
                             DraftConfig())
                for index, kind in enumerate(["dspark", "dspark", "ngram", "dspark", "none"])]
    results = engine.run(requests, {index: index % 2 for index in range(len(requests))})
    for request in requests:
        expected = generate_plain(target, request.prompt_ids, request.config, decode=_decode).token_ids
        assert results[request.request_id].token_ids == expected, request.drafter
    assert engine.runners.dspark.stats.forwards["compiled"] > 0
    assert "dspark" in engine.runners.snapshot()
