"""The demo build's DSpark phase: the target writes text, its DSpark drafter trains on it.

Shared by the demo build (builder.py: after the full pair) and `manage.py train_dspark` (any
target directory). The target continues prompts cut from the standard library's training files
(half greedy, half sampled at T = 1) and greedily continues prompts from the held-out files for
the figures and the calibration; the sequences are kept in the training's work directory, so a
resumed phase does not write them again. `train_dspark` (engine) does the rest and publishes
the checkpoint atomically. The checkpoint's `training_report.json` records the hash of what it
was built from (`build_hash`): a finished phase of the same hash is reused as it is.

Where the drafter goes: `dspark_directory_for(target_dir)`, beside the target. Registering it
as the target's drafter is the registry's business, not this module's.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from inference.demo import corpus
from inference.demo.build_config import DSparkBuildConfig
from inference.engine.drafters.dspark.sequences import continue_sequences
from inference.engine.drafters.dspark.training import (
    REPORT_FILE,
    TrainingProgress,
    train_dspark,
    work_directory,
)
from inference.engine.lm.loading import load_causal_lm

DSPARK_SUFFIX = "-dspark"
SEQUENCES_FILE = "sequences.pt"
#: The phases this module reports to a build observer, in order.
PHASES = ("dspark_text", "train_dspark")


def dspark_directory_for(target_dir: str | os.PathLike[str]) -> Path:
    """Where the DSpark drafter of the target at `target_dir` lies: `<target_dir>-dspark/`."""
    target_dir = Path(target_dir)
    return target_dir.with_name(f"{target_dir.name}{DSPARK_SUFFIX}")


def finished_report(out_dir: Path, build_hash: str) -> dict[str, Any] | None:
    """The report of a finished DSpark checkpoint at `out_dir` built from `build_hash`, or None."""
    try:
        report = json.loads((out_dir / REPORT_FILE).read_text())
    except (OSError, ValueError):
        return None
    whole = (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file()
    return report if whole and isinstance(report, dict) and report.get("build_hash") == build_hash else None


def _windows(tokenizer: PreTrainedTokenizerBase, files: list[corpus.SourceFile], count: int, length: int,
             max_chars: int, seed: int) -> torch.Tensor:
    """[count, length] token windows at seeded offsets in a spread of `files`' text."""
    picked = corpus.spread_files(files, max_chars) if files else []
    texts = list(corpus.iter_texts(picked, max_chars=max_chars))
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
    if len(ids) < length + 1:
        raise corpus.CorpusError(f"{len(ids)} tokens of corpus text: too few for {length}-token prompts")
    stream = torch.tensor(ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.randint(0, stream.numel() - length, (count,), generator=generator)
    return torch.stack([stream[o:o + length] for o in offsets.tolist()])


def target_text(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: DSparkBuildConfig,
                on_rows: Callable[[int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(training [sequences, L], held-out [heldout_sequences, L]) rows the target wrote; L =
    prompt_tokens + new_tokens. `on_rows(done)` counts the rows written so far."""
    train_files, heldout_files = corpus.split_heldout(corpus.stdlib_source_files())
    prompts = _windows(tokenizer, train_files, config.sequences, config.prompt_tokens,
                       config.corpus_chars, config.seed)
    heldout_prompts = _windows(tokenizer, heldout_files, config.heldout_sequences, config.prompt_tokens,
                               max(config.corpus_chars // 10, 50_000), config.seed + 1)
    sampled = round(config.sequences * config.sampled_fraction)
    done = 0

    def counted(offset: int) -> Callable[[int], None]:
        return lambda rows: on_rows(offset + rows) if on_rows is not None else None

    parts = []
    for temperature, rows in ((0.0, prompts[sampled:]), (1.0, prompts[:sampled])):
        if rows.shape[0]:
            parts.append(continue_sequences(target, rows, config.new_tokens, temperature=temperature,
                                            seed=config.seed, on_batch=counted(done)))
            done += rows.shape[0]
    heldout = continue_sequences(target, heldout_prompts, config.new_tokens, on_batch=counted(done))
    return torch.cat(parts), heldout


class _Observer:
    """What the phase tells a build observer (builder.BuildObserver's two methods)."""

    def phase_started(self, phase: str, total: int) -> None: ...

    def step_done(self, done: int) -> None: ...


def build_dspark(target_dir: str | os.PathLike[str], config: DSparkBuildConfig, *,
                 out_dir: str | os.PathLike[str] | None = None, build_hash: str | None = None,
                 resume: bool = True, observer: Any = None,
                 on_progress: Callable[[TrainingProgress], None] | None = None,
                 device: str = "cpu") -> dict[str, Any]:
    """Train (or reuse, or resume) the DSpark drafter of the target at `target_dir`; its report.

    `out_dir` defaults to `dspark_directory_for(target_dir)`. `build_hash` (default: the
    config's) names what the checkpoint is built from; a finished one of the same hash is reused.
    `observer` (phase_started/step_done) is told the phases of PHASES: the text phase counts
    rows, the training phase counts seconds of its budget. `device`: where the target writes and
    the drafter trains (the checkpoint is saved the same either way).
    """
    target_dir = Path(target_dir)
    out = Path(out_dir) if out_dir is not None else dspark_directory_for(target_dir)
    build_hash = build_hash or config.digest()
    if resume:
        report = finished_report(out, build_hash)
        if report is not None:
            return report
    observer = observer or _Observer()
    loaded = load_causal_lm(target_dir)
    target = loaded.model.to(device)
    work = work_directory(out)
    if not resume:
        shutil.rmtree(work, ignore_errors=True)  # the saved text and training state of earlier runs
    cache = work / SEQUENCES_FILE
    rows = _cached_text(cache, build_hash)
    if rows is None:
        observer.phase_started(PHASES[0], config.sequences + config.heldout_sequences)
        rows = target_text(target, loaded.tokenizer, config, on_rows=observer.step_done)
        work.mkdir(parents=True, exist_ok=True)
        torch.save({"build_hash": build_hash, "train": rows[0], "heldout": rows[1]}, cache.with_suffix(".tmp"))
        os.replace(cache.with_suffix(".tmp"), cache)
    observer.phase_started(PHASES[1], max(1, round(config.budget_s)))

    def tell(event: TrainingProgress) -> None:
        if event.stage == "train":
            observer.step_done(min(round(event.elapsed_s), max(1, round(config.budget_s))))
        if on_progress is not None:
            on_progress(event)

    report = train_dspark(target, rows[0], out, heldout=rows[1], block_size=config.block_size,
                          layers=config.layers, markov_rank=config.markov_rank, budget_s=config.budget_s,
                          resume=True, progress=tell, batch_size=config.batch_size,
                          anchors_per_sequence=config.anchors_per_sequence, lr=config.lr, seed=config.seed,
                          report_extra={"build_hash": build_hash, "target_dir": str(target_dir)})
    observer.step_done(max(1, round(config.budget_s)))
    return report


def _cached_text(path: Path, build_hash: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    try:
        saved = torch.load(path, weights_only=True)
    except Exception:  # absent, torn or foreign: write the text again
        return None
    if saved.get("build_hash") != build_hash:
        return None
    return saved["train"], saved["heldout"]
