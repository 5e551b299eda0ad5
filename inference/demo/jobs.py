"""The demo build as a job: build (or resume, or reuse), record progress, register, promote.

`manage.py build_demo_models` runs these; `make run` runs `--quick-first` in the background:
the quick pair (`demo:quick-<seed>`, `DemoBuildConfig.starter`, well under a minute) is
registered and promoted when nothing else serves, then the full pair (`demo:seed<seed>`, the
default config, 10+ minutes) trains at a lower priority and is promoted over the quick one.
Each build's progress is in Redis (`inference.demo.progress`, `inference.build_records`); a
killed build resumes from its checkpoints the next time.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from django.db import DatabaseError, connection
from django.db.migrations.executor import MigrationExecutor

from inference.build_records import DONE, FAILED, INTERRUPTED
from inference.conf import conf
from inference.demo.builder import DemoBuildConfig, DemoModels, build_demo_models, build_dspark_phase
from inference.demo.progress import BuildProgress, build_phases
from metadata.models import ModelVersion
from inference.demo.dspark_phase import dspark_directory_for
from inference.registry import DEMO_NAME, attach_dspark, full_version, quick_version, register_demo_pair

QUICK_SUBDIR = "quick"  # the quick pair lives in SPECOPS_MODEL_DIR/quick/, the full one at the top


class MigrationsPending(Exception):
    """The database schema is still not migrated after the wait."""


@dataclass(frozen=True)
class DemoJob:
    """One build: its version, configuration and output directory."""

    version: str
    config: DemoBuildConfig
    out_dir: Path

    @classmethod
    def quick(cls, seed: int = 0, config: DemoBuildConfig | None = None) -> DemoJob:
        return cls(quick_version(seed), config or DemoBuildConfig.starter(seed), conf.MODEL_DIR / QUICK_SUBDIR)

    @classmethod
    def full(cls, seed: int = 0, config: DemoBuildConfig | None = None) -> DemoJob:
        return cls(full_version(seed), config or DemoBuildConfig(seed=seed), conf.MODEL_DIR)


@dataclass(frozen=True)
class JobResult:
    built: DemoModels
    target: ModelVersion | None  # None with register=False
    promoted: bool


def wait_for_migrations(timeout_s: float, stream: TextIO | None = sys.stdout) -> None:
    """Return once every migration is applied (`make run` migrates while this job trains)."""
    deadline = time.monotonic() + timeout_s
    told = False
    while True:
        try:
            executor = MigrationExecutor(connection)
            if not executor.migration_plan(executor.loader.graph.leaf_nodes()):
                return
        except DatabaseError:
            pass
        finally:
            connection.close()
        if time.monotonic() >= deadline:
            raise MigrationsPending(f"the database is not migrated after {timeout_s:g} s (run manage.py migrate)")
        if not told and stream is not None:
            stream.write("demo build: waiting for the database migrations to finish\n")
            stream.flush()
            told = True
        time.sleep(1.0)


def run_job(job: DemoJob, *, device: str = "cpu", register: bool = True, threads: int | None = None,
            progress: BuildProgress | None = None, tqdm_bars: bool = True,
            migrations_timeout_s: float = 0.0, stream: TextIO | None = sys.stdout) -> JobResult:
    """Build `job` (resuming or reusing what is on disk), then register and maybe promote it.

    The progress record ends as done, failed or interrupted (Ctrl-C, SIGTERM as
    KeyboardInterrupt): whoever reads it never sees a dead build as running.
    """
    progress = progress or BuildProgress(DEMO_NAME, job.version, stream=stream, phases=build_phases(job.config))
    progress.started()
    try:
        # The pair first, registered (and promoted) as soon as it is trained; its DSpark drafter
        # (the full build's last phase, ~10 min on a CPU) after, attached when it is done.
        built = build_demo_models(job.out_dir, config=job.config, progress=tqdm_bars, cache_dir=conf.CACHE_DIR,
                                  threads=threads, observer=progress, dspark=False)
        target, promoted = None, False
        if register:
            if migrations_timeout_s > 0:
                wait_for_migrations(migrations_timeout_s, stream)
            target, promoted = register_demo_pair(job.version, built.target_dir, built.draft_dir, device=device)
        if job.config.dspark is not None:
            built = build_dspark_phase(job.out_dir, config=job.config, threads=threads, observer=progress)
        dspark_dir = dspark_directory_for(built.target_dir)
        if target is not None and (dspark_dir / "config.json").is_file() and target.dspark_directory != dspark_dir:
            attach_dspark(target, dspark_dir)  # `drafter: "dspark"` serves from now on
    except (KeyboardInterrupt, SystemExit):
        progress.finished(INTERRUPTED, "stopped; the next run resumes from the last checkpoint")
        raise
    except Exception as exc:
        progress.finished(FAILED, f"{type(exc).__name__}: {exc}")
        raise
    progress.finished(DONE, "promoted" if promoted else ("registered" if register else "built"))
    return JobResult(built, target, promoted)


def lower_priority(increment: int) -> None:
    """Let serving have the CPU first: the full build is background work."""
    if increment > 0:
        try:
            os.nice(increment)
        except OSError:
            pass
