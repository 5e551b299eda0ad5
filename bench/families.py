"""The family matrix as a benchmark: every family's tiny random pair through the batched engine,
on the eager path and on the compiled one.

    .venv/bin/python bench/families.py [--families llama,gemma2] [--paths eager,compiled] [--new-tokens 32]
        [--repeats 3] [--dtype float32] [--compile-dir var/compiled-families]

For each family of tests/inference/engine/family_models.py (plus two layouts the engine refuses:
Qwen3-Next's linear attention, Llama 4's chunked attention) it saves a target/draft pair with
`save_pretrained`, checks it as `register_model` would (`check_servable`), loads it as the worker
would (float32 on a CPU unless `--dtype`), and runs on each path of `--paths` (default both):

* eager: the engine as a worker with `SPECOPS_ENGINE_COMPILE=off` runs it (growing caches);
* compiled: `CompileSettings(mode="auto", store=--compile-dir)` with every runner's packages
  built (`compile_now`, bench/serving_paths.compiled_engine) before anything is timed; a family
  the static forward does not run (runner/static_forward.py: only the Llama layout compiles)
  serves eagerly there, its reason printed. Packages are kept in the store: a second run finds
  them built.

and on each path:

* greedy identity: every prompt alone (draft-model chain) and all of them at 8 concurrent rows
  (drafters mixed: draft model, tree, n-gram, none) against transformers' own greedy `generate`;
* identical to its own plain decoding: the same outputs against the engine's own plain decoding
  on that path (drafter "none", one row at a time). The compiled forward computes in another
  order than the eager one, so its logits differ in their last bits and may pick another argmax
  where two logits nearly tie: a compiled family that differs from `generate` but equals its own
  plain decoding is lossless (speculation changed nothing) and differs only by rounding; it is
  reported as such (`own plain` yes, `identical` NO, and a line naming the prompt), not hidden;
* tokens/s alone (one request at a time) and at 8 concurrent (generated tokens over wall time),
  medians of `--repeats` runs;
* what served: on the eager path "lean" (modeling.py runs the decoder layers itself) or "wrapped"
  (the model's own forward); on the compiled path "compiled" when the target's runner served
  compiled forwards (`engine.runners.target.stats.forwards["compiled"] > 0`), else
  "eager (<why>)" (the static forward's refusal, or the runner's fallback).

Tiny models (2 layers, hidden 64) time the engine's per-step overheads more than any matmul:
compare families with each other, not with the demo pair. The last line is machine readable:

RESULT families=<n> greedy_identical=<a>/<b> refused=<n> crashes=<n> compiled_served=<n>
    compiled_greedy_identical=<a>/<b> compiled_own_plain_identical=<a>/<b> compiled_fallbacks=<n>
    compiled_crashes=<n> compiled_over_eager_alone_median=<x>

families: families tried; greedy_identical: of those served on the eager path, how many matched
generate in every run; refused: refused at registration (one-line reason printed); crashes: any
other exception on the eager path (or before either path). compiled_served: families whose target
ran compiled forwards; compiled_greedy_identical: of those served on the compiled path (compiled
or fallen back), how many matched generate in every run; compiled_own_plain_identical: how many
matched their own plain decoding on the compiled path in every run; compiled_fallbacks: served on
the compiled path but eagerly (refused by the static forward, or a package that did not build or
load); compiled_crashes: exceptions on the compiled path; compiled_over_eager_alone_median: the
median over the families that ran compiled of their tokens/s alone, compiled over eager (with
both paths only). The keys of a path not run are left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

from bench.common import ROOT, say  # noqa: E402
from bench.serving_paths import compiled_engine  # noqa: E402
from inference.engine import DraftConfig, GenerationConfig  # noqa: E402
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest  # noqa: E402
from inference.engine.batch.policy import SpeculationPolicy  # noqa: E402
from inference.engine.lm.loading import LoadedModel, ModelLoadError, check_servable, load_model_pair  # noqa: E402
from inference.engine.lm.modeling import supports_lean_forward  # noqa: E402
from tests.inference.engine.family_models import FAMILIES, save_family_pair, shared_tokenizer  # noqa: E402

# Layouts the engine refuses, probed so the refusal path is part of the run: (name, model_type, fields)
REFUSED_PROBES = (("qwen3_next", "qwen3_next", {"num_hidden_layers": 4}),
                  ("llama4_text", "llama4_text", {"num_hidden_layers": 4, "attention_chunk_size": 16}))
TEXTS = ("def main(argv):\n    parser = argparse.ArgumentParser()\n", "import os\nclass A:\n",
         "x = [i * i for i in range(10)]\n", "while True:\n", "for line in open(path):\n",
         "return {key: value for key, value in items}\n", "try:\n    import json\n", "if __name__ == '__main__':\n")
DRAFTERS = ("draft_model", "tree", "ngram", "none")
CONCURRENT = 8
PATHS = ("eager", "compiled")
DEFAULT_STORE = ROOT / "var" / "compiled-families"


@dataclass
class Pair:
    """A family's loaded pair, its prompts and transformers' greedy outputs for them."""

    target: LoadedModel
    draft: LoadedModel
    prompts: list[list[int]]
    expected: list[list[int]]


def reference(target_dir: Path, dtype: torch.dtype, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate` on a model loaded by its own defaults, cut after EOS."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    eos = shared_tokenizer().eos_token_id
    outputs = []
    for prompt in prompts:
        tokens = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0, len(prompt):]
        tokens = tokens.tolist()
        outputs.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    return outputs


def prepare(family: str, root: Path, dtype: torch.dtype | None, new_tokens: int) -> Pair:
    """Save, check (ModelLoadError: refused) and load the family's pair; generate's outputs."""
    target_dir, draft_dir = save_family_pair(family, root)
    check_servable(AutoConfig.from_pretrained(target_dir))
    target, draft = load_model_pair(target_dir, draft_dir, dtype=dtype)
    tokenizer = shared_tokenizer()
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    return Pair(target, draft, prompts, reference(target_dir, target.model.dtype, prompts, new_tokens))


def timed_run(engine: BatchedSpeculativeEngine, requests: list[BatchRequest]) -> tuple[dict, float]:
    started = time.perf_counter()
    results = engine.run(requests)
    return results, time.perf_counter() - started


def build_engine(pair: Pair, path: str, store: Path) -> tuple[BatchedSpeculativeEngine, float]:
    """The path's engine; on the compiled path every package built first (the seconds it took)."""
    options = {"policy": SpeculationPolicy(enabled=False), "max_rows": CONCURRENT}
    if path == "eager":
        return BatchedSpeculativeEngine(pair.target, pair.draft, **options), 0.0
    return compiled_engine(pair.target, pair.draft, store, **options)


def served_by(engine: BatchedSpeculativeEngine, path: str, target) -> str:
    """What ran the target's forwards: see the module docstring."""
    if path == "eager":
        return "lean" if supports_lean_forward(target) else "wrapped"
    runner = engine.runners.target
    if runner is None:
        return f"eager ({engine.runners.refusals.get('target', 'no runner')})"
    if runner.stats.forwards["compiled"] > 0:
        draft = engine.runners.draft
        return "compiled" if draft is not None and draft.stats.forwards["compiled"] > 0 else "compiled (draft eager)"
    return f"eager ({runner.stats.fallback or 'no forward ran compiled'})"


def first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def measure(pair: Pair, path: str, store: Path, new_tokens: int, repeats: int) -> dict:
    """One family's row on one path: identical (to generate, to its own plain decoding), tokens/s
    alone and at 8, what served; `differences` names each prompt and run that differed."""
    engine, build_seconds = build_engine(pair, path, store)
    try:
        generation = GenerationConfig(max_new_tokens=new_tokens)
        draft_config = DraftConfig(length=3, tree_width=2, tree_depth=3, node_budget=6)
        plain = [engine.run([BatchRequest(index, prompt, generation, "none")])[index].token_ids
                 for index, prompt in enumerate(pair.prompts)]
        differences: list[str] = []

        def check(index: int, tokens: list[int], run: str) -> tuple[bool, bool]:
            to_generate, to_plain = tokens == pair.expected[index], tokens == plain[index]
            if not (to_generate and to_plain):
                if not to_generate and to_plain:
                    what = (f"differs from generate at new token {first_difference(tokens, pair.expected[index])}, "
                            "equals its own plain decoding (the forward's rounding, not speculation)")
                elif not to_generate:
                    what = (f"differs from generate at new token {first_difference(tokens, pair.expected[index])} "
                            f"and from its own plain decoding at {first_difference(tokens, plain[index])}")
                else:
                    what = (f"equals generate, differs from its own plain decoding at new token "
                            f"{first_difference(tokens, plain[index])}")
                line = f"prompt {index} {TEXTS[index]!r} ({run}): {what}"
                if line not in differences:
                    differences.append(line)
            return to_generate, to_plain

        identical = own_plain = True
        for index, tokens in enumerate(plain):
            identical &= check(index, tokens, "plain, alone")[0]
        solo_rates, busy_rates = [], []
        for _ in range(repeats):
            tokens = seconds = 0.0
            for index, prompt in enumerate(pair.prompts):
                results, elapsed = timed_run(engine, [BatchRequest(index, prompt, generation, "draft_model",
                                                                   draft_config)])
                same = check(index, results[index].token_ids, "draft_model, alone")
                identical, own_plain = identical and same[0], own_plain and same[1]
                tokens, seconds = tokens + len(results[index].token_ids), seconds + elapsed
            solo_rates.append(tokens / seconds)
            busy = [BatchRequest(index, prompt, generation, DRAFTERS[index % len(DRAFTERS)], draft_config)
                    for index, prompt in enumerate(pair.prompts[:CONCURRENT])]
            results, elapsed = timed_run(engine, busy)
            for request in busy:
                same = check(request.request_id, results[request.request_id].token_ids,
                             f"{request.drafter}, at {CONCURRENT}")
                identical, own_plain = identical and same[0], own_plain and same[1]
            busy_rates.append(sum(len(result.token_ids) for result in results.values()) / elapsed)
        target = pair.target.model
        return {"identical": identical, "own_plain": own_plain, "solo": statistics.median(solo_rates),
                "busy": statistics.median(busy_rates), "served": served_by(engine, path, target),
                "build_s": build_seconds, "differences": differences, "attention": pair.target.attn_implementation,
                "dtype": str(target.dtype).removeprefix("torch.")}
    finally:
        engine.runners.close()


def probe_refusal(model_type: str, fields: dict) -> str | None:
    """The one-line reason `register_model` would give, or None if the layout is served."""
    try:
        check_servable(AutoConfig.for_model(model_type, **fields))
    except ModelLoadError as refused:
        return str(refused)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated model types (default: all of family_models.py)")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated of eager, compiled (default both)")
    parser.add_argument("--compile-dir", type=Path, default=DEFAULT_STORE,
                        help=f"the compiled path's package store (default {DEFAULT_STORE.relative_to(ROOT)})")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default=None,
                        help="default: the loader's (float32 on a CPU)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    paths = [path for path in PATHS if path in args.paths.split(",")]
    if not paths or set(args.paths.split(",")) - set(PATHS):
        parser.error(f"--paths: a comma-separated subset of {','.join(PATHS)}")
    torch.set_num_threads(args.threads)
    transformers_logging.disable_progress_bar()  # a line per family and path, not per checkpoint
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)  # loading a package
    families = args.families.split(",") if args.families else list(FAMILIES)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    args.compile_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    refused = 0
    counts = {path: {"served": 0, "identical": 0, "own_plain": 0, "crashes": 0} for path in paths}
    compiled_served = fallbacks = 0
    ratios = []
    say(f"{'family':<12} {'path':<8} {'identical':>9} {'own plain':>9} {'tok/s solo':>10} {'tok/s @8':>9} "
        f"{'build s':>7} {'attention':>9} {'dtype':<7} served")
    with tempfile.TemporaryDirectory(prefix="specops-families-") as root:
        for family in families:
            try:
                pair = prepare(family, Path(root), dtype, args.new_tokens)
            except ModelLoadError as error:
                refused += 1
                say(f"{family:<12} refused: {error}")
                continue
            except Exception:  # noqa: BLE001 - a crash is a figure of this benchmark
                counts[paths[0]]["crashes"] += 1
                say(f"{family:<12} CRASH before any path\n{traceback.format_exc(limit=4)}")
                continue
            rows = {}
            for path in paths:
                try:
                    row = measure(pair, path, args.compile_dir, args.new_tokens, args.repeats)
                except Exception:  # noqa: BLE001
                    counts[path]["crashes"] += 1
                    say(f"{family:<12} {path:<8} CRASH\n{traceback.format_exc(limit=4)}")
                    continue
                rows[path] = row
                count = counts[path]
                count["served"] += 1
                count["identical"] += row["identical"]
                count["own_plain"] += row["own_plain"]
                say(f"{family:<12} {path:<8} {'yes' if row['identical'] else 'NO':>9} "
                    f"{'yes' if row['own_plain'] else 'NO':>9} {row['solo']:>10.1f} {row['busy']:>9.1f} "
                    f"{row['build_s']:>7.1f} {row['attention']:>9} {row['dtype']:<7} {row['served']}")
                for line in row["differences"]:
                    say(f"{'':<12} {path:<8} {line}")
            compiled = rows.get("compiled")
            if compiled is not None:
                if compiled["served"].startswith("compiled"):
                    compiled_served += 1
                    if "eager" in rows:
                        ratios.append(compiled["solo"] / rows["eager"]["solo"])
                else:
                    fallbacks += 1
            del pair
    probes = [] if args.families else REFUSED_PROBES
    for name, model_type, fields in probes:
        reason = probe_refusal(model_type, fields)
        refused += reason is not None
        say(f"{name:<12} refused: {reason}" if reason else f"{name:<12} served (probe expected a refusal)")
    say(f"took {time.perf_counter() - started:.0f} s")
    keys = [f"families={len(families) + len(probes)}"]
    if "eager" in counts:
        eager = counts["eager"]
        keys += [f"greedy_identical={eager['identical']}/{eager['served']}", f"refused={refused}",
                 f"crashes={eager['crashes']}"]
    else:
        keys.append(f"refused={refused}")
    if "compiled" in counts:
        compiled = counts["compiled"]
        keys += [f"compiled_served={compiled_served}",
                 f"compiled_greedy_identical={compiled['identical']}/{compiled['served']}",
                 f"compiled_own_plain_identical={compiled['own_plain']}/{compiled['served']}",
                 f"compiled_fallbacks={fallbacks}", f"compiled_crashes={compiled['crashes']}"]
        if "eager" in counts:
            median = statistics.median(ratios) if ratios else float("nan")
            keys.append(f"compiled_over_eager_alone_median={median:.2f}")
    print("RESULT " + " ".join(keys), flush=True)


if __name__ == "__main__":
    main()
