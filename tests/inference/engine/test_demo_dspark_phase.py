"""The demo build's DSpark phase: after the pair, the target's DSpark drafter trains beside it.

Builds use `DemoBuildConfig.quick()` (the toy pair, seconds) with a toy DSpark phase added; the
quick preset itself has none. A finished pair gains the phase without being retrained, the phase
is recorded in `build.json`, reported to the observer, and resumes after an interruption.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from inference.demo.build_config import DemoBuildConfig, DSparkBuildConfig
from inference.demo.builder import DSPARK_PHASES, build_demo_models, build_dspark_phase, dspark_directory_for
from inference.engine.drafters.dspark import load_dspark
from inference.engine.drafters.dspark.training import work_directory
from inference.engine.lm.loading import load_causal_lm

TOY_DSPARK = DSparkBuildConfig(budget_s=1.5, sequences=8, heldout_sequences=4, prompt_tokens=8, new_tokens=24,
                               corpus_chars=50_000, block_size=3, markov_rank=8)
QUICK = DemoBuildConfig.quick(seed=0)
QUICK_WITH_DSPARK = dataclasses.replace(QUICK, dspark=TOY_DSPARK)


class Phases:
    """A build observer that remembers the phases it was told, and can stop the build in one."""

    def __init__(self, stop_in: str | None = None) -> None:
        self.seen: list[str] = []
        self.stop_in = stop_in

    def phase_started(self, phase: str, total: int) -> None:
        self.seen.append(phase)

    def step_done(self, done: int) -> None:
        if self.seen and self.seen[-1] == self.stop_in:
            raise KeyboardInterrupt


@pytest.fixture(scope="module")
def pair_without_dspark(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    return root, build_demo_models(root, config=QUICK, progress=False, threads=1)


def test_the_quick_presets_train_no_dspark_drafter(pair_without_dspark):
    root, built = pair_without_dspark
    assert QUICK.dspark is None and DemoBuildConfig.starter().dspark is None
    assert DemoBuildConfig().dspark is not None  # the full pair has one
    assert built.dspark_dir is None and not dspark_directory_for(built.target_dir).exists()
    assert "dspark" not in json.loads((root / "build.json").read_text())["metrics"]


def test_the_dspark_phase_does_not_change_the_pairs_hash():
    assert QUICK_WITH_DSPARK.digest() == QUICK.digest()
    assert DemoBuildConfig(seed=0).digest() == "e7f0ee87fb77dfdf"  # finished full builds stay valid


def test_a_finished_pair_gains_its_dspark_drafter_without_being_retrained(pair_without_dspark):
    root, built = pair_without_dspark
    target_weights = built.target_dir / "model.safetensors"
    stamp = target_weights.stat().st_mtime_ns
    observer = Phases()
    with_dspark = build_demo_models(root, config=QUICK_WITH_DSPARK, progress=False, threads=1, observer=observer)
    assert observer.seen == list(DSPARK_PHASES)  # no phase of the pair ran again
    assert target_weights.stat().st_mtime_ns == stamp
    assert with_dspark.dspark_dir == dspark_directory_for(built.target_dir) == root / "demo-target-dspark"
    model = load_dspark(with_dspark.dspark_dir, load_causal_lm(built.target_dir).model)
    assert model.block_size == 3 and len(model.calibration) == 3
    recorded = json.loads((root / "build.json").read_text())["metrics"]["dspark"]
    assert recorded["directory"] == "demo-target-dspark" and recorded["steps"] > 0
    assert recorded["final"]["loss"] < recorded["initial"]["loss"]
    again = Phases()
    assert build_demo_models(root, config=QUICK_WITH_DSPARK, progress=False, observer=again).dspark_dir
    assert again.seen == []  # reused as it is


def test_an_interrupted_dspark_phase_resumes_and_the_pair_is_served_meanwhile(tmp_path):
    root = tmp_path / "demo"
    with pytest.raises(KeyboardInterrupt):
        build_demo_models(root, config=QUICK_WITH_DSPARK, progress=False, threads=1,
                          observer=Phases(stop_in="train_dspark"))
    target_dir = root / "demo-target"
    assert (target_dir / "config.json").is_file() and (root / "build.json").is_file()  # the pair is whole
    assert not dspark_directory_for(target_dir).exists()  # the drafter is not half-written
    assert (work_directory(dspark_directory_for(target_dir)) / "sequences.pt").is_file()
    observer = Phases()
    finished = build_dspark_phase(root, config=QUICK_WITH_DSPARK, threads=1, observer=observer)
    assert observer.seen == ["train_dspark"]  # the target's text was kept, not written again
    assert finished.dspark_dir is not None and (finished.dspark_dir / "config.json").is_file()
    assert not work_directory(finished.dspark_dir).exists()


def test_the_dspark_phase_needs_a_finished_pair(tmp_path):
    from inference.demo.builder import DemoBuildError

    with pytest.raises(DemoBuildError, match="no finished demo pair"):
        build_dspark_phase(tmp_path / "empty", config=QUICK_WITH_DSPARK)
