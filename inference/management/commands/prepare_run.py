"""Everything `make run` does before it starts the processes, in one Python process.

collectstatic, migrate, create_operator and `partitions schedule` as separate `manage.py`
calls each paid Django's start-up and the imports of the apps (torch, transformers): on a busy
2-core machine ~25 s each, most of a first run's minute. Here they run in order in one
process; any failure stops the rest with a one-line error and a non-zero exit.

The static files come first, and `--static-file` is written as soon as they are collected:
WhiteNoise indexes `STATIC_ROOT` once, when the web process starts, so a web started before
them serves the admin without its styles until it is restarted. `make run` starts the web once
that file is there. With `--ready-file`, that file is written once the database is ready, so
`make run` can start what needs the tables; with `--then-build-demo-models` the same process goes
on to build the demo models (`build_demo_models --quick-first`) while they start: no second
start-up.
"""
from __future__ import annotations

from pathlib import Path

from django.core.management import call_command
from django.core.management.base import BaseCommand


def _touch(marker: Path | None, text: str) -> None:
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(text)


class Command(BaseCommand):
    help = ("Collect static files, migrate, create the first operator and schedule partition jobs; "
            "optionally then build the demo models (make run).")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--static-file", type=Path, default=None,
                            help="Write this file once the static files are collected (make run then starts the web).")
        parser.add_argument("--ready-file", type=Path, default=None,
                            help="Write this file once the database is ready (make run waits for it).")
        parser.add_argument("--then-build-demo-models", action="store_true",
                            help="Then build the quick demo pair and the full one (build_demo_models --quick-first).")
        parser.add_argument("--threads", type=int, default=None, help="Passed to build_demo_models.")
        parser.add_argument("--seed", type=int, default=0, help="Passed to build_demo_models.")
        parser.add_argument("--serving-file", type=Path, default=None, help="Passed to build_demo_models.")

    def handle(self, *args, static_file: Path | None, ready_file: Path | None, then_build_demo_models: bool,
               threads: int | None, seed: int, serving_file: Path | None, **options) -> None:
        out = {"stdout": self.stdout, "stderr": self.stderr}
        call_command("collectstatic", interactive=False, verbosity=0, **out)
        _touch(static_file, "collected\n")
        call_command("migrate", interactive=False, verbosity=0, **out)
        call_command("create_operator", **out)
        call_command("partitions", "schedule", **out)
        _touch(ready_file, "ready\n")
        if then_build_demo_models:
            call_command("build_demo_models", quick_first=True, threads=threads, seed=seed,
                         serving_file=serving_file, **out)
