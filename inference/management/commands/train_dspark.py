"""Train a DSpark drafter for a target, on text the target writes itself.

`manage.py train_dspark --target NAME_OR_DIR --out DIR [--minutes 10] [--block-size 7]
[--no-resume]`: the target (a model directory, or a registered target: `demo`, `demo:seed0`)
continues prompts from the standard library's source, its DSpark drafter trains for the given
minutes with the target frozen, is calibrated on held-out text and written to DIR in DeepSpec's
layout (inference.demo.dspark_phase, inference.engine.drafters.dspark.training). A killed run
resumes from its last checkpoint unless --no-resume. DIR is written whole or not at all; bad
input is a one-line error and a non-zero exit. Registering DIR as the target's drafter is
`register_model`'s business.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from inference.demo.build_config import DSparkBuildConfig
from inference.demo.corpus import CorpusError
from inference.engine.drafters.dspark.checkpoint import is_dspark_checkpoint
from inference.engine.drafters.dspark.training import TrainingProgress
from inference.engine.errors import EngineError

MAX_BLOCK_SIZE = 16


def resolve_target(spec: str) -> Path:
    """A model directory as given, else the directory of the registered target `name[:version]`."""
    path = Path(spec)
    if path.is_dir():
        return path
    if path.exists():
        raise CommandError(f"--target {spec}: is a file, not a model directory")
    from django.db import DatabaseError

    from metadata.models import ModelRole, ModelVersion, VersionStatus
    from inference.registry import split_model_id

    name, version = split_model_id(spec)
    versions = ModelVersion.objects.filter(name=name, role=ModelRole.TARGET)
    if version is not None:
        versions = versions.filter(version=version)
    try:
        found = (versions.filter(status=VersionStatus.ACTIVE).first()
                 or versions.order_by("-created_at").first())
    except DatabaseError as exc:
        raise CommandError(f"--target {spec}: not a directory, and the registry is unreachable "
                           f"({str(exc).splitlines()[0]})") from None
    if found is None:
        raise CommandError(f"--target {spec}: neither a model directory nor a registered target")
    return found.directory


class Command(BaseCommand):
    help = ("Train a target's DSpark drafter on text the target writes (target frozen), calibrate it on "
            "held-out text, and write it to --out in DeepSpec's layout.")
    requires_system_checks: list[str] = []

    def add_arguments(self, parser) -> None:
        parser.add_argument("--target", required=True, help="A model directory or a registered target (name[:version]).")
        parser.add_argument("--out", required=True, type=Path, help="Where the DSpark checkpoint goes.")
        parser.add_argument("--minutes", type=float, default=10.0, help="Training time budget (default 10).")
        parser.add_argument("--block-size", type=int, default=7, help="Draft positions per block (default 7).")
        parser.add_argument("--sequences", type=int, default=None,
                            help="Training sequences the target writes (default: the demo build's).")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--threads", type=int, default=None, help="Torch threads (default: torch's).")
        parser.add_argument("--no-resume", action="store_true", help="Start afresh instead of from the last checkpoint.")

    def handle(self, *args, target: str, out: Path, minutes: float, block_size: int, sequences: int | None,
               seed: int, threads: int | None, no_resume: bool, **options) -> None:
        if not minutes > 0:
            raise CommandError(f"--minutes must be positive, not {minutes:g}")
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise CommandError(f"--block-size must be between 1 and {MAX_BLOCK_SIZE}, not {block_size}")
        if sequences is not None and sequences < 2:
            raise CommandError(f"--sequences must be at least 2, not {sequences}")
        if threads is not None and threads < 1:
            raise CommandError(f"--threads must be at least 1, not {threads}")
        target_dir = resolve_target(target)
        _check_out(out, target_dir)
        config = DSparkBuildConfig(budget_s=minutes * 60.0, block_size=block_size, seed=seed)
        if sequences is not None:
            config = replace(config, sequences=sequences)
        import torch

        from inference.demo.dspark_phase import build_dspark
        from inference.engine.lm.loading import ModelLoadError

        previous_threads = torch.get_num_threads()
        torch.set_num_threads(threads or previous_threads)
        try:
            report = build_dspark(target_dir, config, out_dir=out, resume=not no_resume,
                                  observer=_Printer(self.stdout), on_progress=_ProgressLines(self.stdout))
        except KeyboardInterrupt:
            raise CommandError("interrupted; run the same command again to resume") from None
        except (ModelLoadError, EngineError, CorpusError, OSError, ValueError) as exc:
            raise CommandError(f"{target}: {str(exc).splitlines()[0]}") from exc
        finally:
            torch.set_num_threads(previous_threads)
        initial, final = report["initial"], report["final"]
        self.stdout.write(
            f"dspark drafter written to {out}: {report['steps']} steps in {report['train_seconds']} s; "
            f"held-out loss {initial['loss']} -> {final['loss']}, tau greedy {initial['tau_greedy']} -> "
            f"{final['tau_greedy']}, tau sampled {initial['tau_sampled']} -> {final['tau_sampled']}; "
            f"confidence ECE {report['ece_uncalibrated']} -> {report['ece_calibrated']} calibrated")


def _check_out(out: Path, target_dir: Path) -> None:
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out}: exists and is not a directory")
    if out.resolve() == Path(target_dir).resolve():
        raise CommandError(f"--out {out}: is the target's own directory")
    if out.is_dir() and any(out.iterdir()) and not is_dspark_checkpoint(out):
        raise CommandError(f"--out {out}: a non-empty directory that is not a DSpark checkpoint; "
                           "refusing to replace it")


class _Printer:
    """The build observer of a command run: one line per phase."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def phase_started(self, phase: str, total: int) -> None:
        unit = "s" if phase == "train_dspark" else "sequences"
        self.stream.write(f"{phase}: {total} {unit}")

    def step_done(self, done: int) -> None:
        pass


class _ProgressLines:
    """A line every 30 s of training, and one per stage."""

    def __init__(self, stream, every_s: float = 30.0) -> None:
        self.stream, self.every_s, self.next_at = stream, every_s, 0.0

    def __call__(self, event: TrainingProgress) -> None:
        if event.stage == "train" and event.elapsed_s < self.next_at:
            return
        self.next_at = event.elapsed_s + self.every_s
        loss = "" if event.loss is None else f" loss {event.loss:.3f}"
        self.stream.write(f"dspark {event.stage}: step {event.step}, {event.elapsed_s:.0f}/{event.budget_s:.0f} s{loss}")
