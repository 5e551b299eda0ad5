"""Build a compiled forward in a process of its own, so compiling never blocks serving.

    python -m inference.engine.runner.builder --model DIR --spec JSON --out PATH

The engine core starts one per missing package (`BackgroundBuild`), at a lower priority, and
goes on serving with the eager forward; the runner loads the package when the process has
renamed it into place. The process loads the model from its directory like any worker does
(no weights are written: a package holds code only, artifacts.py). Exit status 0 with the
package written, else 1 with one line on stderr saying why.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from inference.engine.runner.artifacts import GraphSpec, build_package

#: niceness of a build process: serving keeps the CPU it needs
BUILD_NICENESS = 10
#: the module a builder process runs (a model's forward)
PROGRAM = "inference.engine.runner.builder"


def _as_builder(niceness: int) -> Callable[[], None]:
    """What the child runs before it execs: a lower priority, and death with the thread that
    started it (an engine core's main thread, or a batching loop's), so no build outlives its engine."""
    def prepare() -> None:
        if niceness:
            os.nice(niceness)
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    return prepare


_in_flight: dict[Path, BackgroundBuild] = {}  # this process's builds by package: runners share one


def background_build(model_dir: Path, dtype: torch.dtype, spec: Any, out: Path, log_dir: Path,
                     niceness: int = BUILD_NICENESS, program: str = PROGRAM) -> BackgroundBuild:
    """The build of package `out`: the one already running in this process (two runners of one
    architecture, a target and its draft, want the same package), else a new one."""
    build = _in_flight.get(out)
    if build is None or build.done():
        build = _in_flight[out] = BackgroundBuild(model_dir, dtype, spec, out, log_dir, niceness, program)
    return build


class BackgroundBuild:
    """One builder process; `done()` says whether it has finished (and whether it succeeded).

    `program` is the module run with ``python -m``: this one builds a model's forward; another
    kind of package has its own (drafters/dspark/compiled.py), taking the same arguments — the
    model's directory, its dtype, the spec (a dataclass, as JSON) and the package's path.
    """

    def __init__(self, model_dir: Path, dtype: torch.dtype, spec: Any, out: Path, log_dir: Path,
                 niceness: int = BUILD_NICENESS, program: str | None = None) -> None:
        self.out = out
        self.started = time.monotonic()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / (out.name + ".log")
        command = [sys.executable, "-m", program or PROGRAM, "--model", str(model_dir),
                   "--dtype", str(dtype).removeprefix("torch."), "--spec", json.dumps(asdict(spec)), "--out", str(out)]
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                             preexec_fn=_as_builder(niceness),
                                             cwd=Path(__file__).resolve().parents[3])

    def done(self) -> bool:
        return self._process.poll() is not None

    @property
    def succeeded(self) -> bool:
        return self._process.poll() == 0 and self.out.exists()

    def failure(self) -> str:
        """The last line the process wrote (why it failed)."""
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        return lines[-1] if lines else f"exit status {self._process.poll()}"

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def run_build(argv: list[str] | None, program: str, description: str,
              build: Callable[[Path, torch.dtype, dict[str, Any], Path], float]) -> int:
    """A builder process's main: parse the arguments `BackgroundBuild` passes, run `build(model_dir,
    dtype, spec fields, out)`, and say in one line what came of it (exit status 0 or 1)."""
    parser = argparse.ArgumentParser(prog=f"python -m {program}", description=description)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--spec", required=True, help="the package's spec as JSON")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        torch.set_num_threads(1)
        seconds = build(args.model, getattr(torch, args.dtype), json.loads(args.spec), args.out)
    except Exception as error:  # one line for the runner's log; the traceback above it in the build's log
        import traceback

        traceback.print_exc()
        print(f"error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", file=sys.stderr)
        return 1
    print(f"built {args.out.name} in {seconds:.1f} s")
    return 0


def _build_forward(model_dir: Path, dtype: torch.dtype, fields: dict[str, Any], out: Path) -> float:
    from transformers import AutoModelForCausalLM

    spec = GraphSpec(**{**fields, "taps": tuple(fields.get("taps", ()))})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()
    return build_package(model, spec, out)


def main(argv: list[str] | None = None) -> int:
    return run_build(argv, PROGRAM, "Build one compiled forward (an AOTInductor package).", _build_forward)


if __name__ == "__main__":
    sys.exit(main())
