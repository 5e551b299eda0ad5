"""Model variants measured against acceptance, on the demo pair, in one run.

    .venv/bin/python bench/optimise.py [--model-dir models] [--prompts 4] [--skip-compiled]

Configurations (target / draft): fp32 / fp32; fp32 / int8 (`int8_draft`); int8 / int8
(`int8_both`); bf16 / bf16; compiled / compiled. Every variant is built (or reused) beside the
fp32 directories by `inference.engine.lm.variants.build_variant_dir`, the code `manage.py
build_variants` runs, and loaded back through `load_causal_lm`, as the worker loads it.

For each configuration: greedy tok/s at batch 1 (SpeculativeDecoder) and batch 8
(BatchedSpeculativeEngine, policy off), both with the draft-model chain at gamma 4, 64 new
tokens, EOS off; acceptance (accepted / drafted) and mean accepted length; per-token agreement
of the configuration's target with the fp32 target, teacher-forced over the fp32 target's own
greedy continuations of the held-out prompts (so one early difference does not count every later
token), and whether the greedy output equals the fp32 target's; weights size of target + draft.
Every ratio is to the fp32 row of the same run; the runs are interleaved across configurations
(`--repeats`), and tok/s is the median. A variant that is not faster than fp32, or that changes
the output, is said so, and the recommended default stays fp32.

Last line:
RESULT int8_draft_speedup=<x> int8_draft_acceptance_delta=<x> best_variant=<name>
       best_speedup_vs_fp32=<x> greedy_identical_int8_draft=<bool>                  (one line)
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.engine import (  # noqa: E402
    DraftConfig,
    GenerationConfig,
    GenerationStats,
    SpeculativeDecoder,
    build_drafter,
    generate_plain,
)
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest  # noqa: E402
from inference.engine.lm.loading import load_causal_lm  # noqa: E402
from inference.engine.batch.policy import SpeculationPolicy  # noqa: E402
from inference.engine.lm.variant_writer import build_variant_dir  # noqa: E402
from inference.engine.lm.variants import model_size_bytes  # noqa: E402

#: configuration -> (target variant, draft variant); None is the fp32 directory itself
CONFIGS = {
    "fp32": (None, None),
    "int8_draft": (None, "int8"),
    "int8_both": ("int8", "int8"),
    "bf16": ("bf16", "bf16"),
    "compiled": ("compiled", "compiled"),
}


@dataclass
class Config:
    """One (target, draft) configuration: its models, outputs and timings."""

    name: str
    target: object
    draft: object
    size_bytes: int
    load_seconds: float
    b1_tps: list[float] = field(default_factory=list)
    b8_tps: list[float] = field(default_factory=list)
    b1_outputs: list[list[int]] = field(default_factory=list)
    b8_outputs: list[list[int]] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    agreement: float = float("nan")
    warmup_seconds: float = 0.0

    @property
    def b1(self) -> float:
        return statistics.median(self.b1_tps)

    @property
    def b8(self) -> float:
        return statistics.median(self.b8_tps) if self.b8_tps else float("nan")


def variant_dir(base: Path, kind: str | None, role: str) -> Path:
    return base if kind is None else build_variant_dir(base, kind, role=role)[0]


def load_config(name: str, target_dir: Path, draft_dir: Path) -> Config:
    target_kind, draft_kind = CONFIGS[name]
    started = time.perf_counter()
    target = load_causal_lm(variant_dir(target_dir, target_kind, "target"))
    draft = load_causal_lm(variant_dir(draft_dir, draft_kind, "draft"))
    return Config(name, target, draft, model_size_bytes(target.model) + model_size_bytes(draft.model),
                  time.perf_counter() - started)


def run_b1(config: Config, prompts: list[list[int]], generation: GenerationConfig, gamma: int) -> None:
    decoder = SpeculativeDecoder(config.target, build_drafter(
        "draft_model", target=config.target, draft=config.draft, config=DraftConfig(length=gamma)))
    outputs, stats, tokens = [], GenerationStats(), 0
    started = time.perf_counter()
    for prompt in prompts:
        result = decoder.generate(prompt, generation)
        outputs.append(result.token_ids)
        stats.merge(result.stats)
        tokens += len(result.token_ids)
    config.b1_tps.append(tokens / (time.perf_counter() - started))
    config.b1_outputs, config.stats = outputs, stats


def run_b8(config: Config, prompts: list[list[int]], generation: GenerationConfig, gamma: int) -> None:
    engine = BatchedSpeculativeEngine(config.target, config.draft, max_rows=len(prompts),
                                      policy=SpeculationPolicy(max_depth=gamma, enabled=False))
    for index, prompt in enumerate(prompts):
        engine.submit(BatchRequest(index, prompt, generation, "draft_model", DraftConfig(length=gamma)))
    outputs: dict[int, list[int]] = {index: [] for index in range(len(prompts))}
    started = time.perf_counter()
    while engine.has_work():
        for event in engine.step():
            outputs[event.request_id].extend(event.step.token_ids)
    config.b8_tps.append(sum(map(len, outputs.values())) / (time.perf_counter() - started))
    config.b8_outputs = [outputs[index] for index in range(len(prompts))]


def teacher_forced_agreement(model, prompts: list[list[int]], references: list[list[int]]) -> float:
    """Share of positions where ``model``'s argmax is the fp32 target's greedy token."""
    agree = total = 0
    with torch.inference_mode():
        for prompt, reference in zip(prompts, references):
            ids = torch.tensor([prompt + reference])
            logits = model(input_ids=ids, logits_to_keep=len(reference) + 1).logits[0, :-1]
            agree += int((logits.argmax(-1) == torch.tensor(reference)).sum())
            total += len(reference)
    return agree / total


def load_prompts(path: Path, tokenizer, count: int) -> list[list[int]]:
    from inference.demo.prompts import load_heldout_prompts

    texts = load_heldout_prompts(path)[:count]
    if len(texts) < count:
        sys.exit(f"error: {path} has {len(texts)} prompts, {count} needed")
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def wait_for_pair(target_dir: Path, draft_dir: Path, build_json: Path, wait_s: float) -> None:
    """Another process may be building the pair: wait for it, never start a build."""
    deadline = time.monotonic() + wait_s
    while not ((target_dir / "config.json").is_file() and (draft_dir / "config.json").is_file()):
        if time.monotonic() > deadline:
            sys.exit(f"error: no demo pair in {target_dir.parent} (build it with manage.py build_demo_models)")
        print(f"waiting for the demo pair ({build_json} / {target_dir.name}, {draft_dir.name}) ...", flush=True)
        time.sleep(30)


def report(configs: list[Config], reference: list[list[int]], reference_b8: list[list[int]]) -> str:
    by_name = {config.name: config for config in configs}
    fp32 = by_name["fp32"]
    print(f"\n{'config':11} {'b1 tok/s':>8} {'x fp32':>6} {'b8 tok/s':>8} {'x fp32':>6} {'accept':>6} "
          f"{'len':>5} {'agree':>6} {'greedy=fp32':>11} {'MB':>6} {'x fp32':>6} {'load s':>6} {'warm s':>6}")
    for c in configs:
        identical = c.b1_outputs == reference and c.b8_outputs == reference_b8
        print(f"{c.name:11} {c.b1:8.1f} {c.b1 / fp32.b1:6.2f} {c.b8:8.1f} {c.b8 / fp32.b8:6.2f} "
              f"{c.stats.acceptance_rate:6.3f} {c.stats.mean_accepted_length:5.2f} {c.agreement:6.3f} "
              f"{str(identical).lower():>11} {c.size_bytes / 1e6:6.2f} {c.size_bytes / fp32.size_bytes:6.2f} "
              f"{c.load_seconds:6.1f} {c.warmup_seconds:6.1f}")
    int8 = by_name["int8_draft"]
    speedup = min(int8.b1 / fp32.b1, int8.b8 / fp32.b8)
    delta = int8.stats.acceptance_rate - fp32.stats.acceptance_rate
    identical_int8 = int8.b1_outputs == reference and int8.b8_outputs == reference_b8
    # a variant counts only if it keeps the fp32 target's greedy output and is faster at both batch sizes
    exact = [c for c in configs if c.name != "fp32" and c.b1_outputs == reference and c.b8_outputs == reference_b8]
    best = max(exact, key=lambda c: min(c.b1 / fp32.b1, c.b8 / fp32.b8), default=None)
    best_speedup = min(best.b1 / fp32.b1, best.b8 / fp32.b8) if best else 1.0
    for c in configs[1:]:
        ratio = min(c.b1 / fp32.b1, c.b8 / fp32.b8)
        changed = c.b1_outputs != reference or c.b8_outputs != reference_b8
        verdict = "pays" if ratio > 1.0 and not changed else "does not pay"
        why = [f"{ratio:.2f}x fp32 at its worse batch size"]
        if changed:
            why.append(f"changes the greedy output (agreement {c.agreement:.3f})")
        print(f"  {c.name}: {verdict} ({'; '.join(why)})")
    if best is None or best_speedup <= 1.0:
        best_name, best_speedup = "fp32", 1.0
        print("no variant is faster than fp32 with the same output here: the default stays fp32")
    else:
        best_name = best.name
        print(f"ship: {best_name} ({best_speedup:.2f}x fp32 at its worse batch size, output identical)")
    return (f"RESULT int8_draft_speedup={speedup:.2f} int8_draft_acceptance_delta={delta:+.3f} "
            f"best_variant={best_name} best_speedup_vs_fp32={best_speedup:.2f} "
            f"greedy_identical_int8_draft={str(identical_int8).lower()}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=os.environ.get("SPECOPS_MODEL_DIR", "models"))
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts at batch 1")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 1 is steadiest on a shared box")
    parser.add_argument("--skip-compiled", action="store_true", help="torch.compile takes minutes on 2 cores")
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for a pair being built")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # dynamo's "recompile limit reached" warnings (a stack each): past the limit those shapes run
    # eagerly, which is part of what the compiled row measures
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = Path(args.model_dir)
    target_dir, draft_dir = model_dir / "demo-target", model_dir / "demo-draft"
    wait_for_pair(target_dir, draft_dir, model_dir / "build.json", args.wait)
    names = [name for name in CONFIGS if not (args.skip_compiled and name == "compiled")]
    configs = [load_config(name, target_dir, draft_dir) for name in names]
    tokenizer = configs[0].target.tokenizer
    prompts_file = model_dir / "heldout_prompts.json"
    b8_prompts = load_prompts(prompts_file, tokenizer, max(args.batch, args.prompts))[: args.batch]
    b1_prompts = b8_prompts[: args.prompts]
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_id=())
    fp32 = configs[0]
    reference = [generate_plain(fp32.target, p, generation).token_ids for p in b1_prompts]
    reference_b8 = [generate_plain(fp32.target, p, generation).token_ids for p in b8_prompts]
    print(f"threads={torch.get_num_threads()} prompts={len(b1_prompts)} (batch 1) / {len(b8_prompts)} "
          f"(batch {args.batch}) max_new_tokens={args.max_new_tokens} gamma={args.gamma} "
          f"repeats={args.repeats}", flush=True)
    for config in configs:  # warm-up (compiles the compiled variant's graphs) and agreement
        started = time.perf_counter()
        run_b1(config, b1_prompts[:1], generation, args.gamma)
        run_b8(config, b8_prompts, generation, args.gamma)
        config.b1_tps.clear(), config.b8_tps.clear()
        config.warmup_seconds = time.perf_counter() - started
        config.agreement = teacher_forced_agreement(config.target.model, b8_prompts, reference_b8)
        print(f"  {config.name}: loaded in {config.load_seconds:.1f} s, warmed up in "
              f"{config.warmup_seconds:.1f} s", flush=True)
    for _ in range(args.repeats):
        for config in configs:
            run_b1(config, b1_prompts, generation, args.gamma)
            run_b8(config, b8_prompts, generation, args.gamma)
    print(report(configs, reference, reference_b8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
