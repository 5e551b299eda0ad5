"""The family matrix as a benchmark: every family's tiny random pair through the batched engine.

    .venv/bin/python bench/families.py [--families llama,gemma2] [--new-tokens 32] [--dtype float32]

For each family of tests/inference/engine/family_models.py (plus two layouts the engine refuses:
Qwen3-Next's linear attention, Llama 4's chunked attention) it saves a target/draft pair with
`save_pretrained`, checks it as `register_model` would (`check_servable`), loads it as the worker
would (float32 on a CPU unless `--dtype`), and runs:

* greedy identity: every prompt alone (draft-model chain) and all of them at 8 concurrent rows
  (drafters mixed: draft model, tree, n-gram, none) against transformers' own greedy `generate`;
* tokens/s alone (one request at a time) and at 8 concurrent (generated tokens over wall time),
  medians of `--repeats` runs;
* the forward path: "lean" (modeling.py runs the decoder layers itself) or "wrapped" (the
  model's own forward).

Tiny models (2 layers, hidden 64) time the engine's per-step overheads more than any matmul:
compare families with each other, not with the demo pair. The last line is machine readable:

RESULT families=<n> greedy_identical=<a>/<b> refused=<n> crashes=<n>

families: families tried; greedy_identical: of those served, how many matched generate in every
run; refused: refused at registration (one-line reason printed); crashes: any other exception.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from bench.common import say  # noqa: E402
from inference.engine import DraftConfig, GenerationConfig  # noqa: E402
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest  # noqa: E402
from inference.engine.batch.policy import SpeculationPolicy  # noqa: E402
from inference.engine.lm.loading import ModelLoadError, check_servable, load_model_pair  # noqa: E402
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


def timed_run(engine: BatchedSpeculativeEngine, requests: list[BatchRequest]) -> tuple[dict, float]:
    started = time.perf_counter()
    results = engine.run(requests)
    return results, time.perf_counter() - started


def measure(family: str, root: Path, dtype: torch.dtype | None, new_tokens: int, repeats: int) -> dict:
    """One family's row: identical, tokens/s alone and at 8, path."""
    target_dir, draft_dir = save_family_pair(family, root)
    check_servable(AutoConfig.from_pretrained(target_dir))
    target, draft = load_model_pair(target_dir, draft_dir, dtype=dtype)
    tokenizer = shared_tokenizer()
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    expected = reference(target_dir, target.model.dtype, prompts, new_tokens)
    engine = BatchedSpeculativeEngine(target, draft, policy=SpeculationPolicy(enabled=False),
                                      max_rows=CONCURRENT)
    generation = GenerationConfig(max_new_tokens=new_tokens)
    draft_config = DraftConfig(length=3, tree_width=2, tree_depth=3, node_budget=6)
    identical = True
    solo_rates, busy_rates = [], []
    for _ in range(repeats):
        tokens = seconds = 0.0
        for index, prompt in enumerate(prompts):
            results, elapsed = timed_run(engine, [BatchRequest(index, prompt, generation, "draft_model", draft_config)])
            identical &= results[index].token_ids == expected[index]
            tokens, seconds = tokens + len(results[index].token_ids), seconds + elapsed
        solo_rates.append(tokens / seconds)
        busy = [BatchRequest(index, prompt, generation, DRAFTERS[index % len(DRAFTERS)], draft_config)
                for index, prompt in enumerate(prompts[:CONCURRENT])]
        results, elapsed = timed_run(engine, busy)
        identical &= all(results[request.request_id].token_ids == expected[request.request_id] for request in busy)
        busy_rates.append(sum(len(result.token_ids) for result in results.values()) / elapsed)
    return {"identical": identical, "solo": statistics.median(solo_rates), "busy": statistics.median(busy_rates),
            "path": "lean" if supports_lean_forward(target.model) else "wrapped",
            "attention": target.attn_implementation, "dtype": str(target.model.dtype).removeprefix("torch.")}


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
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default=None,
                        help="default: the loader's (float32 on a CPU)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    families = args.families.split(",") if args.families else list(FAMILIES)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    identical = served = refused = crashes = 0
    say(f"{'family':<12} {'identical':>9} {'tok/s solo':>10} {'tok/s @8':>9} {'path':>8} {'attention':>9} dtype")
    with tempfile.TemporaryDirectory(prefix="specops-families-") as root:
        for family in families:
            try:
                row = measure(family, Path(root), dtype, args.new_tokens, args.repeats)
            except ModelLoadError as error:
                refused += 1
                say(f"{family:<12} refused: {error}")
                continue
            except Exception:  # noqa: BLE001 - a crash is a figure of this benchmark
                crashes += 1
                say(f"{family:<12} CRASH\n{traceback.format_exc(limit=4)}")
                continue
            served += 1
            identical += row["identical"]
            say(f"{family:<12} {'yes' if row['identical'] else 'NO':>9} {row['solo']:>10.1f} {row['busy']:>9.1f} "
                f"{row['path']:>8} {row['attention']:>9} {row['dtype']}")
    probes = [] if args.families else REFUSED_PROBES
    for name, model_type, fields in probes:
        reason = probe_refusal(model_type, fields)
        refused += reason is not None
        say(f"{name:<12} refused: {reason}" if reason else f"{name:<12} served (probe expected a refusal)")
    print(f"RESULT families={len(families) + len(probes)} greedy_identical={identical}/{served} "
          f"refused={refused} crashes={crashes}", flush=True)


if __name__ == "__main__":
    main()
