"""Linear kernels benchmark: the demo pair's forwards with torch's own products and with oneDNN's
where the engine chose it (inference/engine/lm/linear_kernels.py), interleaved, one run.

    .venv/bin/python bench/matmul_kernels.py [--model-dir models] [--repeats 7]

For each forward shape the batched engine runs (rows x new tokens on a ragged cache of ~100
slots; prefills of 48-token prompts on an empty one), the median milliseconds with the kernels
off (`torch`) and on (`chosen`), measured alternately so a noisy neighbour slows both alike, and
whether the logits are the same bit for bit (they must be: the engine only takes a kernel that
gave F.linear's bits). Then the decisions per weight shape. Last line:

RESULT prefill8x48_speedup=<x> prefill1x48_speedup=<x> verify8x4_speedup=<x> verify16x4_speedup=<x>
       decode8x1_speedup=<x> verify1x5_speedup=<x> logits_identical=<bool>
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.engine.lm.linear_kernels import LinearKernels, onednn_available, set_linear_kernels  # noqa: E402
from inference.engine.kv.ragged import RaggedCache, RowInput  # noqa: E402
from bench.common import load_demo_pair, require_demo_pair  # noqa: E402

# (name, model, rows, new tokens, cached tokens per row, logits kept)
SHAPES = (
    ("verify1x5", "target", 1, 5, 100, "all"),
    ("decode8x1", "target", 8, 1, 100, "all"),
    ("verify8x4", "target", 8, 4, 100, "all"),
    ("verify16x4", "target", 16, 4, 100, "all"),
    ("prefill1x48", "target", 1, 48, 0, "last"),
    ("prefill8x48", "target", 8, 48, 0, "last"),
    ("draft8x1", "draft", 8, 1, 100, "all"),
)


def forward_once(model, rows: int, new: int, cached: int, logits: str) -> tuple[float, torch.Tensor]:
    """One forward of `rows` x `new` tokens on a cache of `cached` tokens per row: (seconds, logits).

    Also bench/serving_ceiling.py's measure of the engine's forwards."""
    cache = RaggedCache(model)
    for _ in range(rows):
        cache.add_row()
    with torch.inference_mode():
        if cached:
            cache.forward([RowInput([(5 + 7 * r + i) % 4000 for i in range(cached)], list(range(cached)))
                           for r in range(rows)], logits="none")
        inputs = [RowInput([(11 + 3 * r + i) % 4000 for i in range(new)], list(range(cached, cached + new)))
                  for r in range(rows)]
        started = time.perf_counter()
        out = cache.forward(inputs, logits=logits)
        seconds = time.perf_counter() - started
    return seconds, torch.cat(out) if out else torch.empty(0)  # logits="none": nothing back


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=os.environ.get("SPECOPS_MODEL_DIR", str(ROOT / "models")))
    parser.add_argument("--repeats", type=int, default=7, help="alternations per shape (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (as the workers run)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir)
    require_demo_pair(model_dir)
    if not onednn_available():
        sys.exit("error: this torch has no oneDNN linear; nothing to compare")
    target, draft = load_demo_pair(model_dir)
    models = {"target": target.model, "draft": draft.model}
    torch_kernels, chosen = LinearKernels(enabled=False), LinearKernels()
    started = time.perf_counter()
    for model in models.values():
        chosen.prepare(model)
    print(f"kernel bench: demo pair, torch threads {torch.get_num_threads()}; decisions made in "
          f"{time.perf_counter() - started:.2f} s", flush=True)
    times: dict[tuple[str, str], list[float]] = {}
    identical = True
    for name, model_name, rows, new, cached, logits in SHAPES:
        model = models[model_name]
        for kernels in (torch_kernels, chosen):  # warm-up
            set_linear_kernels(kernels)
            forward_once(model, rows, new, cached, logits)
        for _ in range(args.repeats):
            outputs = []
            for label, kernels in (("torch", torch_kernels), ("chosen", chosen)):
                set_linear_kernels(kernels)
                seconds, out = forward_once(model, rows, new, cached, logits)
                times.setdefault((name, label), []).append(seconds)
                outputs.append(out)
            identical = identical and torch.equal(*outputs)
    print(f"{'forward':<12} {'torch ms':>9} {'chosen ms':>10} {'speedup':>8}")
    speedups = {}
    for name, *_ in SHAPES:
        base = statistics.median(times[(name, "torch")]) * 1000
        ours = statistics.median(times[(name, "chosen")]) * 1000
        speedups[name] = base / ours
        print(f"{name:<12} {base:>9.2f} {ours:>10.2f} {base / ours:>8.2f}")
    print("decisions (out x in): " + "; ".join(f"{key[0]}x{key[1]}: {choice.reason}"
                                              for key, choice in chosen.choices.items()))
    print(f"RESULT prefill8x48_speedup={speedups['prefill8x48']:.2f} "
          f"prefill1x48_speedup={speedups['prefill1x48']:.2f} verify8x4_speedup={speedups['verify8x4']:.2f} "
          f"verify16x4_speedup={speedups['verify16x4']:.2f} decode8x1_speedup={speedups['decode8x1']:.2f} "
          f"verify1x5_speedup={speedups['verify1x5']:.2f} logits_identical={str(identical).lower()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
