"""The two forward paths bench/serving.py compares: the eager engine and the compiled one, and
the outside reference for a compiled decode (transformers' StaticCache + torch.compile).

The compiled engine's packages are built before anything is timed (`compile_now`, into
`var/compiled` by default, where a worker finds them too), so a run measures serving, not
compiling; a second run finds them built.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench.closed_loop import Run
from bench.common import ROOT
from bench.hf_compiled import HFCompiledGreedy
from inference.engine.batch.engine import BatchedSpeculativeEngine
from inference.engine.batch.runners import CompileSettings

COMPILED_SUFFIX = ""  # the compiled path's runs keep the method names (spec_* are the compiled path's)
EAGER_SUFFIX = "_eager"


def compile_settings(store: Path) -> CompileSettings:
    return CompileSettings(mode="auto", store=store, background=False)


def compiled_engine(target, draft, store: Path, **options) -> tuple[BatchedSpeculativeEngine, float]:
    """A batched engine on the compiled path with every package built; the seconds building took."""
    started = time.perf_counter()
    engine = BatchedSpeculativeEngine(target, draft, compile=compile_settings(store), **options)
    for runner in engine.runners.all():
        runner.compile_now()
    for role, why in engine.runners.refusals.items():
        print(f"  the {role} runs eagerly: {why}", flush=True)
    return engine, time.perf_counter() - started


def run_hf_compiled(target, prompts, max_new_tokens: int) -> Run:
    """transformers' own compiled greedy loop, one prompt at a time (c = 1); ITL is its decode step."""
    run = Run("hf_compiled", 1)
    generator = HFCompiledGreedy(target, max(len(p) for p in prompts) + max_new_tokens + 1)
    generator.generate(prompts[0], 4)  # compiles the step (minutes the first time, cached after)
    started = time.perf_counter()
    for prompt in prompts:
        tokens, step_seconds = generator.generate(prompt, max_new_tokens)
        run.outputs.append(tokens)
        run.itl.append(step_seconds)
    run.seconds = time.perf_counter() - started
    return run


def worker_ready_seconds(model_dir: Path, store: Path, threads: int = 1) -> float:
    """Seconds from starting an engine-core process (a worker's) to its first compiled step, the
    demo pair's packages already in `store` (bench/worker_ready.py)."""
    started = time.perf_counter()
    process = subprocess.run([sys.executable, str(ROOT / "bench" / "worker_ready.py"), str(model_dir), str(store)],
                             capture_output=True, text=True, timeout=600, cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    seconds = time.perf_counter() - started
    if process.returncode != 0 or "READY" not in process.stdout:
        raise RuntimeError(f"worker_ready.py failed: {process.stderr.strip().splitlines()[-1:]}")
    return seconds


def token_agreement(target, store: Path, texts: list[list[int]], chunk: int = 64) -> float:
    """The share of positions of held-out text at which the compiled target's argmax equals the
    eager target's, teacher-forced (each position reads the text, not the model's own tokens, so
    one difference does not carry on)."""
    import torch

    from inference.engine.kv.ragged import RaggedCache, RowInput

    engine, _ = compiled_engine(target, None, store, decode=lambda tokens: "", max_rows=1)
    compiled_cache = engine.runners.new_cache(target)
    same = total = 0
    with torch.inference_mode():
        for text in texts:
            argmax = []
            for cache in (RaggedCache(target), compiled_cache):
                cache.keep_rows([])
                cache.add_row()
                tokens = []
                for start in range(0, len(text), chunk):
                    piece = text[start:start + chunk]
                    tokens.append(cache.forward([RowInput(piece, list(range(start, start + len(piece))))])[0]
                                  .argmax(dim=-1))
                argmax.append(torch.cat(tokens))
            same += int((argmax[0] == argmax[1]).sum())
            total += len(text)
    return same / max(total, 1)
