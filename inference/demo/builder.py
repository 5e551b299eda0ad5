"""Build the demo target/draft pair from the standard library's source, without a network.

Phases: train a tokenizer → train the target → let the target write greedy text → distil the
draft from the target → save both with `save_pretrained` → load them back through
`load_causal_lm` and estimate greedy acceptance on held-out prompts. Each phase checkpoints into
`out_dir/.build/`; `build.json` marks a finished build with the hash of its configuration, so the
same configuration is reused at once and a different one is rebuilt.

Then, for a config with `dspark` (the full pair; the quick ones have none), the DSpark phase
(dspark_phase.py): the target writes text and its DSpark drafter trains on it within a time
budget, resumable, into `dspark_directory_for(target_dir)`. It has its own hash (the pair's and
its own settings'), recorded in the drafter's directory and under `metrics["dspark"]` in
`build.json`: a finished pair gains the phase without being retrained.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from inference.demo import corpus
from inference.demo.build_config import DemoBuildConfig
from inference.demo.dspark_phase import PHASES as DSPARK_PHASES
from inference.demo.dspark_phase import build_dspark, dspark_directory_for, finished_report
from inference.demo.model_files import (
    ModelShape,
    causal_lm_config,
    random_causal_lm,
    save_model_dir,
)
from inference.demo.prompts import heldout_prompts
from inference.demo.tokenizer_builder import (
    save_atomically,
    stdlib_tokenizer,
    train_tokenizer,
)
from inference.demo.training import (
    distil_draft,
    encode_stream,
    forward_cost_ms,
    generate_greedy_rows,
    greedy_acceptance,
    train_language_model,
)
from inference.engine.lm.loading import load_causal_lm
from inference.heldout_prompts import load_heldout_prompts, write_heldout_prompts

__all__ = [
    "DSPARK_PHASES",
    "PHASES",
    "BuildObserver",
    "DemoBuildConfig",
    "DemoBuildError",
    "DemoModels",
    "build_demo_models",
    "build_dspark_phase",
    "dspark_directory_for",
    "load_heldout_prompts",
]

TARGET_DIR, DRAFT_DIR = "demo-target", "demo-draft"
PROMPTS_FILE, MARKER = "heldout_prompts.json", "build.json"
#: The phases of a build, in order (the keys of `metrics["phase_seconds"]`).
PHASES = ("tokenizer_and_data", "train_target", "target_greedy_text", "distil_draft",
          "save_and_evaluate")


class BuildObserver(Protocol):
    """Told where a build is, for a progress record (the Django command's `BuildProgress`)."""

    def phase_started(self, phase: str, total: int) -> None:
        """`phase` (one of PHASES) begins; it has `total` steps (1 when it is not counted)."""

    def step_done(self, done: int) -> None:
        """`done` of the current phase's steps are finished (the first call of a resumed phase
        already counts the steps done before the interruption)."""


class DemoBuildError(Exception):
    """The demo build cannot run (bad configuration, unusable output directory)."""


@dataclass(frozen=True)
class DemoModels:
    """Where a finished demo build lies, and what it measured."""

    target_dir: Path
    draft_dir: Path
    heldout_prompts_path: Path
    metrics: dict[str, Any] = field(default_factory=dict)
    #: the target's DSpark drafter (DeepSpec's layout), when this build trained one
    dspark_dir: Path | None = None


def _outputs(root: Path, metrics: dict[str, Any]) -> DemoModels:
    dspark = metrics.get("dspark")
    return DemoModels(root / TARGET_DIR, root / DRAFT_DIR, root / PROMPTS_FILE, metrics,
                      root / dspark["directory"] if dspark else None)


def dspark_build_hash(config: DemoBuildConfig) -> str | None:
    """What the DSpark drafter is built from: the pair's hash and the phase's; None without one."""
    return None if config.dspark is None else f"{config.digest()}-{config.dspark.digest()}"


def _dspark_current(root: Path, config: DemoBuildConfig, marker: dict[str, Any]) -> bool:
    """Whether the finished build at `root` needs no DSpark phase (none asked, or done and recorded)."""
    build_hash = dspark_build_hash(config)
    if build_hash is None:
        return True
    recorded = (marker.get("metrics") or {}).get("dspark") or {}
    return (recorded.get("build_hash") == build_hash
            and finished_report(dspark_directory_for(root / TARGET_DIR), build_hash) is not None)


def _finished(root: Path, config: DemoBuildConfig) -> dict[str, Any] | None:
    """Return the marker of a finished build of this config, or None."""
    try:
        marker = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None
    complete = all((root / name / "config.json").is_file() for name in (TARGET_DIR, DRAFT_DIR))
    prompts = (root / PROMPTS_FILE).is_file()
    return marker if marker.get("config_hash") == config.digest() and complete and prompts else None


def _prepare_workdir(root: Path, config: DemoBuildConfig) -> Path:
    """Return `.build/`, emptied if it holds the phases of another configuration."""
    work = root / ".build"
    state = work / "state.json"
    if work.exists():
        try:
            same = json.loads(state.read_text()).get("config_hash") == config.digest()
        except (OSError, ValueError):
            same = False
        if not same:
            shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"config_hash": config.digest()}))
    return work


def _tokenizer(work: Path, config: DemoBuildConfig, cache_dir: Path | None) -> PreTrainedTokenizerBase:
    """Train the tokenizer, or take the one a build of the same vocabulary left in `cache_dir`."""
    directory = work / "tokenizer"
    if not (directory / "tokenizer.json").is_file():
        if cache_dir is None:
            texts = corpus.sample_texts(config.tokenizer_sample_chars)
            tokenizer = train_tokenizer(texts, config.vocab_size,
                                        model_max_length=config.context_length)
        else:
            tokenizer = stdlib_tokenizer(config.vocab_size, config.tokenizer_sample_chars, cache_dir)
            tokenizer.model_max_length = config.context_length
        save_atomically(tokenizer, directory)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def _data(work: Path, config: DemoBuildConfig, tokenizer: PreTrainedTokenizerBase,
          progress: bool) -> torch.Tensor:
    """Encode the training split once; write the held-out prompts from the held-out split."""
    stream_path, prompts_path = work / "train_tokens.pt", work / PROMPTS_FILE
    if stream_path.is_file() and prompts_path.is_file():
        return torch.load(stream_path, weights_only=True)
    train, heldout = corpus.split_heldout(corpus.stdlib_source_files(), config.heldout_fraction)
    if config.corpus_spread and config.max_corpus_chars is not None:
        train = corpus.spread_files(train, config.max_corpus_chars)
    texts = list(corpus.iter_texts(train, max_chars=config.max_corpus_chars))
    stream = encode_stream(tokenizer, texts, progress=progress)
    prompts = heldout_prompts(heldout, tokenizer, config.prompt_count, config.prompt_tokens,
                              min_following_tokens=config.eval_new_tokens)
    write_heldout_prompts(prompts_path, prompts)
    torch.save(stream, stream_path.with_suffix(".tmp"))
    os.replace(stream_path.with_suffix(".tmp"), stream_path)
    return stream


def _trained_model(work: Path, name: str, shape: ModelShape, config: DemoBuildConfig,
                   tokenizer: PreTrainedTokenizerBase,
                   train: Callable[[PreTrainedModel, Path], None],
                   init_from: PreTrainedModel | None = None, device: str = "cpu") -> PreTrainedModel:
    """Initialise, train (resuming from a checkpoint) and save a model; reuse it once saved."""
    directory = work / name
    marker = {"phase": name, "config_hash": config.digest()}
    if (directory / "config.json").is_file():
        return load_causal_lm(directory).model.to(device)
    model = random_causal_lm(causal_lm_config(config.arch, shape, tokenizer), config.seed).to(device)
    if init_from is not None:
        copy_matching_weights(init_from, model)
    train(model, work / f"{name}.ckpt")
    save_model_dir(model, tokenizer, directory, marker)
    (work / f"{name}.ckpt").unlink(missing_ok=True)
    return model.eval()


def copy_matching_weights(source: PreTrainedModel, destination: PreTrainedModel) -> list[str]:
    """Start the draft from the target: same-named, same-shaped tensors are copied.

    With equal widths that is the embeddings, the output head, the final norm and the first
    layers, so the draft begins in the target's token space instead of from noise, and
    distillation only has to teach a shallow stack to imitate the deep one. Returns the names.
    """
    source_state = source.state_dict()
    copied = {
        name: source_state[name]
        for name, tensor in destination.state_dict().items()
        if name in source_state and source_state[name].shape == tensor.shape
    }
    destination.load_state_dict(copied, strict=False)
    return sorted(copied)


def _evaluate(root: Path, config: DemoBuildConfig, device: str = "cpu") -> dict[str, Any]:
    """Load the saved pair the way production does and measure what speculation will see."""
    target = load_causal_lm(root / TARGET_DIR)
    draft = load_causal_lm(root / DRAFT_DIR)
    target.model.to(device)
    draft.model.to(device)
    prompts = [torch.tensor(target.tokenizer(text)["input_ids"]) for text in
               load_heldout_prompts(root / PROMPTS_FILE)]
    metrics: dict[str, Any] = greedy_acceptance(target.model, draft.model, prompts,
                                                config.eval_new_tokens, draft_length=4)
    context = min(200, config.context_length - 8)
    target_ms = forward_cost_ms(target.model, context=context)
    draft_ms = forward_cost_ms(draft.model, context=context)
    metrics.update(
        target_forward_ms=round(target_ms, 3),
        target_forward_5_ms=round(forward_cost_ms(target.model, context=context, new=5), 3),
        draft_forward_ms=round(draft_ms, 3),
        draft_target_cost_ratio=round(draft_ms / target_ms, 3),
        target_parameters=sum(p.numel() for p in target.model.parameters()),
        draft_parameters=sum(p.numel() for p in draft.model.parameters()),
    )
    return metrics


class _Silent:
    """The observer of a build nobody watches."""

    def phase_started(self, phase: str, total: int) -> None:
        pass

    def step_done(self, done: int) -> None:
        pass


def _run_phases(root: Path, config: DemoBuildConfig, progress: bool,
                cache_dir: Path | None, observer: BuildObserver, device: str = "cpu") -> dict[str, Any]:
    """Run (or skip, when already done) each phase in order; return the evaluation metrics."""
    work = _prepare_workdir(root, config)
    seconds: dict[str, float] = {}
    bar = tqdm(total=5, desc="demo build", unit="phase", disable=not progress)
    totals = dict(zip(PHASES, (1, config.target_optim.steps, config.greedy_sequences,
                               config.draft_optim.steps, 1)))

    def begin(name: str) -> float:
        observer.phase_started(name, totals[name])
        return time.monotonic()

    def timed(name: str, started: float) -> None:
        seconds[name] = round(time.monotonic() - started, 1)
        if totals[name] == 1:
            observer.step_done(1)
        bar.update(1)

    step = observer.step_done
    started = begin("tokenizer_and_data")
    tokenizer = _tokenizer(work, config, cache_dir)
    stream = _data(work, config, tokenizer, progress)
    timed("tokenizer_and_data", started)
    started = begin("train_target")
    deadline = None if config.target_budget_s is None else started + config.target_budget_s
    target = _trained_model(work, "target", config.target, config, tokenizer,
                            lambda model, ckpt: train_language_model(
                                model, stream, config.target_optim, config.seed, ckpt, progress,
                                on_step=step,
                                should_stop=None if deadline is None else lambda: time.monotonic() >= deadline),
                            device=device)
    timed("train_target", started)
    started = begin("target_greedy_text")
    greedy_rows = generate_greedy_rows(target, stream, config.greedy_sequences,
                                       config.greedy_prompt_tokens, config.greedy_new_tokens,
                                       config.seed, work / "greedy.pt", progress=progress,
                                       on_step=step)
    timed("target_greedy_text", started)
    started = begin("distil_draft")
    _trained_model(work, "draft", config.draft, config, tokenizer,
                   lambda model, ckpt: distil_draft(model, target, stream, greedy_rows,
                                                    config.draft_optim, config.seed, ckpt,
                                                    config.greedy_fraction, progress,
                                                    on_step=step),
                   init_from=target if config.draft_from_target else None, device=device)
    timed("distil_draft", started)
    started = begin("save_and_evaluate")
    for name, final in (("target", TARGET_DIR), ("draft", DRAFT_DIR)):
        _replace_dir(work / name, root / final)
    shutil.copyfile(work / PROMPTS_FILE, root / PROMPTS_FILE)
    metrics = _evaluate(root, config, device)
    timed("save_and_evaluate", started)
    bar.close()
    metrics["phase_seconds"] = seconds
    return metrics


def build_demo_models(
    out_dir: str | os.PathLike[str],
    config: DemoBuildConfig | None = None,
    progress: bool = True,
    cache_dir: Path | None = None,
    threads: int | None = None,
    observer: BuildObserver | None = None,
    dspark: bool = True,
    device: str = "cpu",
) -> DemoModels:
    """Build (or resume, or reuse) the demo pair under `out_dir`; see the module docstring.

    `cache_dir` (the Django command passes SPECOPS_CACHE_DIR) keeps the trained tokenizer for the
    next build of the same vocabulary; None trains it inside the build. `threads` caps torch's
    threads (None: every core this process may use); on a busy machine one thread is much
    faster than two that wait on each other. `observer` is told each phase and step.
    `dspark=False` leaves out the DSpark phase (`build_dspark_phase` runs it later).
    `device` is where the models train and write text ("cuda" where one is lent: the recipe is
    the same, minutes instead of hours; what is saved is the same float32 model either way).
    """
    config = config or DemoBuildConfig()
    root = Path(out_dir)
    if root.exists() and not root.is_dir():
        raise DemoBuildError(f"output path {root} exists and is not a directory")
    marker = _finished(root, config)
    if marker is not None and (not dspark or _dspark_current(root, config, marker)):
        return _outputs(root, marker.get("metrics", {}))
    observer = observer or _Silent()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    try:
        if marker is None:
            started = time.monotonic()
            (root / MARKER).unlink(missing_ok=True)
            metrics = _run_phases(root, config, progress, cache_dir, observer, device)
            metrics["build_seconds"] = round(time.monotonic() - started, 1)
            _write_marker(root, config, metrics)  # its presence means the pair is whole
            shutil.rmtree(root / ".build")
        else:
            metrics = dict(marker.get("metrics", {}))
        if dspark and config.dspark is not None:
            metrics = _dspark_phase(root, config, metrics, observer, device)
    finally:
        torch.set_num_threads(previous_threads)
    return _outputs(root, metrics)


def build_dspark_phase(out_dir: str | os.PathLike[str], config: DemoBuildConfig | None = None,
                       threads: int | None = None, observer: BuildObserver | None = None) -> DemoModels:
    """Only the DSpark phase, on the finished pair at `out_dir` (for a job that registers the
    pair before it trains the drafter: `build_demo_models(..., dspark=False)` first)."""
    config = config or DemoBuildConfig()
    root = Path(out_dir)
    marker = _finished(root, config)
    if marker is None:
        raise DemoBuildError(f"{root}: no finished demo pair of this configuration to train a DSpark drafter for")
    if config.dspark is None or _dspark_current(root, config, marker):
        return _outputs(root, marker.get("metrics", {}))
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    try:
        metrics = _dspark_phase(root, config, dict(marker.get("metrics", {})), observer or _Silent())
    finally:
        torch.set_num_threads(previous_threads)
    return _outputs(root, metrics)


def _dspark_phase(root: Path, config: DemoBuildConfig, metrics: dict[str, Any],
                  observer: BuildObserver, device: str = "cpu") -> dict[str, Any]:
    """Train (resume, reuse) the target's DSpark drafter; record it in the marker's metrics."""
    started = time.monotonic()
    build_hash = dspark_build_hash(config)
    report = build_dspark(root / TARGET_DIR, config.dspark, build_hash=build_hash, observer=observer,
                          device=device)
    directory = dspark_directory_for(root / TARGET_DIR)
    metrics["dspark"] = {
        "directory": directory.name, "build_hash": build_hash,  # relative: the root may move
        "phase_seconds": round(time.monotonic() - started, 1),
        **{key: report.get(key) for key in ("steps", "train_seconds", "train_sequences", "heldout_sequences",
                                            "block_size", "target_layer_ids", "final_losses", "initial",
                                            "final", "temperatures", "ece_uncalibrated", "ece_calibrated")},
    }
    _write_marker(root, config, metrics)
    return metrics


def _write_marker(root: Path, config: DemoBuildConfig, metrics: dict[str, Any]) -> None:
    record = {"config_hash": config.digest(), "config": asdict(config), "metrics": metrics}
    staging = root / f".{MARKER}.tmp"
    staging.write_text(json.dumps(record, indent=2, sort_keys=True))
    os.replace(staging, root / MARKER)


def _replace_dir(source: Path, destination: Path) -> None:
    """Copy a finished model into place so the destination is whole or absent."""
    staging = destination.with_name(f".{destination.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    if destination.exists():
        shutil.rmtree(destination)
    os.replace(staging, destination)


def main(argv: list[str] | None = None) -> int:
    """Command line: build the demo pair into --out; one-line errors, non-zero exit on failure."""
    parser = argparse.ArgumentParser(prog="python -m inference.demo.builder",
                                     description="Build the demo target/draft pair.")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="toy sizes, seconds (smoke test)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--device", default="cpu", help="where to train: cpu (default) or cuda")
    parser.add_argument("--dspark-budget-s", type=float,
                        help="the DSpark phase's training budget (default: the recipe's; another value is "
                             "another DSpark build, with its own hash)")
    parser.add_argument("--dspark-sequences", type=int,
                        help="target-written sequences the DSpark drafter trains on (default: the recipe's)")
    args = parser.parse_args(argv)
    config = DemoBuildConfig.quick(args.seed) if args.quick else DemoBuildConfig(seed=args.seed)
    try:
        config = _with_dspark_overrides(config, args.dspark_budget_s, args.dspark_sequences)
        if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
            raise ValueError(f"--device must be cpu or cuda, not {args.device!r}")
        if args.device != "cpu" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device here")
        models = build_demo_models(args.out, config=config, progress=not args.no_progress, device=args.device)
    except KeyboardInterrupt:
        print("error: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except (DemoBuildError, corpus.CorpusError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    summary = {key: models.metrics.get(key) for key in
               ("acceptance", "token_match", "draft_target_cost_ratio", "build_seconds")}
    print(f"target={models.target_dir} draft={models.draft_dir} "
          f"prompts={models.heldout_prompts_path} dspark={models.dspark_dir} {json.dumps(summary)}")
    return 0


def _with_dspark_overrides(config: DemoBuildConfig, budget_s: float | None,
                           sequences: int | None) -> DemoBuildConfig:
    """The config with the DSpark phase's budget or text size changed (ValueError naming the flag)."""
    if budget_s is None and sequences is None:
        return config
    if config.dspark is None:
        raise ValueError("--dspark-budget-s/--dspark-sequences: this configuration has no DSpark phase")
    changes: dict[str, Any] = {}
    if budget_s is not None:
        if not budget_s > 0:
            raise ValueError(f"--dspark-budget-s must be above 0, not {budget_s}")
        changes["budget_s"] = budget_s
    if sequences is not None:
        if sequences < 2:
            raise ValueError(f"--dspark-sequences must be at least 2, not {sequences}")
        changes["sequences"] = sequences
    return dataclasses.replace(config, dspark=dataclasses.replace(config.dspark, **changes))


if __name__ == "__main__":
    sys.exit(main())
