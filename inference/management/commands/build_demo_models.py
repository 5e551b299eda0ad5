"""Build the demo target/draft pair into SPECOPS_MODEL_DIR and register it as model 'demo'.

Plain: the full pair (`demo:seed<seed>`, reused when already built, resumed when interrupted).
`--quick`: only the quick pair (`demo:quick-<seed>`, well under a minute). `--quick-first`:
the quick pair, then the full one in the same process at a lower priority (what `make run`
runs in the background). Progress goes to stdout (one line per phase and every
`--progress-every` seconds) and to Redis, where the admin dashboard and the API read it.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from inference.demo.corpus import CorpusError
from inference.demo.builder import DemoBuildError
from inference.demo.jobs import DemoJob, MigrationsPending, lower_priority, run_job
from inference.demo.progress import BuildProgress, build_phases
from inference.registry import DEMO_NAME, QUICK_PREFIX, RegistrationError


def _interrupt_on_sigterm() -> None:
    """SIGTERM (run.sh stopping) ends the build like Ctrl-C: recorded as interrupted, resumable.

    What it prints from then on goes where its errors go (`make run`: var/log/demo-build.log), so
    the terminal of a stopped `make run` shows that script's one line, not the build's too.
    """
    def handler(signum, frame):
        try:
            sys.stdout.flush()
            os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # streams without a file (captured): as they are
            pass
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


class Command(BaseCommand):
    help = ("Train the demo tokenizer, target and distilled draft (reused when already built, resumed when "
            "interrupted), then register them; --quick-first serves a quick pair first.")
    # The build needs no URLconf: skipping the checks saves importing the API (seconds on a busy machine).
    requires_system_checks: list[str] = []

    def add_arguments(self, parser) -> None:
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--device", default="cpu", help="Device the registered versions run on (cpu or cuda:N).")
        parser.add_argument("--no-register", action="store_true", help="Only build the files.")
        which = parser.add_mutually_exclusive_group()
        which.add_argument("--quick", action="store_true",
                           help="Build only the quick pair (demo:quick-SEED, well under a minute).")
        which.add_argument("--quick-first", action="store_true",
                           help="The quick pair, then the full one at a lower priority (make run).")
        parser.add_argument("--threads", type=int, default=None,
                            help="Torch threads of the full build (default: every core). The quick pair always "
                                 "trains on one: a model that small gains nothing from two, and loses much when "
                                 "the cores are busy.")
        parser.add_argument("--nice", type=int, default=10,
                            help="With --quick-first: lower the priority by this much before the full build.")
        parser.add_argument("--progress-every", type=float, default=15.0, metavar="SECONDS",
                            help="Print a progress line this often (default 15).")
        parser.add_argument("--wait-for-migrations", type=float, default=0.0, metavar="SECONDS",
                            help="Before registering, wait up to this long for migrate (make run migrates meanwhile).")
        parser.add_argument("--serving-file", type=Path, default=None,
                            help="Write this file once the first pair is registered (make run then starts the rest).")

    def handle(self, *args, seed: int, device: str, no_register: bool, quick: bool, quick_first: bool,
               threads: int | None, nice: int, progress_every: float, wait_for_migrations: float,
               serving_file: Path | None = None, **options) -> None:
        if threads is not None and threads < 1:
            raise CommandError(f"--threads must be at least 1, not {threads}")
        _interrupt_on_sigterm()
        jobs = [DemoJob.quick(seed)] if quick or quick_first else []
        if not quick:
            jobs.append(DemoJob.full(seed))
        for index, job in enumerate(jobs):
            if quick_first and index == 1:
                lower_priority(nice)
            job_threads = 1 if job.version.startswith(QUICK_PREFIX) else threads
            self._run(job, device, not no_register, job_threads, progress_every, wait_for_migrations)
            if serving_file is not None and index == 0:
                serving_file.parent.mkdir(parents=True, exist_ok=True)
                serving_file.write_text(f"{DEMO_NAME}:{job.version}\n")

    def _run(self, job: DemoJob, device: str, register: bool, threads: int | None, progress_every: float,
             wait_for_migrations: float) -> None:
        limits = {} if job.config.target_budget_s is None else {"train_target": job.config.target_budget_s}
        progress = BuildProgress(DEMO_NAME, job.version, stream=self.stdout, print_every_s=progress_every,
                                 phase_limits_s=limits, phases=build_phases(job.config))
        try:
            result = run_job(job, device=device, register=register, threads=threads, progress=progress,
                             migrations_timeout_s=wait_for_migrations, stream=self.stdout)
        except KeyboardInterrupt:
            raise CommandError(f"{DEMO_NAME}:{job.version} interrupted; run the same command again to resume") from None
        except (RegistrationError, MigrationsPending, DemoBuildError, CorpusError, OSError, ValueError) as exc:
            raise CommandError(f"{DEMO_NAME}:{job.version}: {exc}") from exc
        built, target = result.built, result.target
        self.stdout.write(f"demo models ready: {built.target_dir} {built.draft_dir}")
        if target is not None:
            state = "promoted: it serves model 'demo' now" if result.promoted else f"status {target.status}"
            self.stdout.write(f"registered {target} with draft {target.default_draft} ({state})")
