"""Speculative decoding benchmark on the demo pair: every method, the same held-out prompts, one run.

    .venv/bin/python bench/engine.py [--model-dir models] [--device cpu|cuda] [--prompts 12]

Methods: target-only greedy with HF `generate`, with our one-at-a-time plain loop and with the
serving engine's compiled plain decoding (the fastest of the three is the baseline), HF assisted
generation (`assistant_model=draft`, constant schedule, same draft length, no confidence
threshold), ours as served (`ours_engine_*`: the batched engine a worker runs, at batch 1, on
its compiled path: whole-model AOTInductor packages over static KV pools, built before timing
into --compile-dir, where a worker finds them too) and ours one at a time with the eager
single-sequence decoder (`SpeculativeDecoder`): the draft-model chain, the n-gram and the tree
drafter. Then tree vs chain at the same node budget (`--budgets`, 8 and 16): for each budget
and temperature (`--temperatures`: greedy, 0.7, 1.0; sampled runs seeded per prompt and pass,
their counters summed over the passes), a chain of `budget` tokens and a dynamic tree of
`budget` nodes, on the demo pair and on the same target with a weaker draft (distilled for
`--weak-steps` steps, built and cached under MODEL_DIR by bench/weak_draft.py). Each method
is warmed up, then timed `--repeats` times over all prompts (methods interleaved, so load
drifts hit them alike); tokens/s is the median. The last line is machine readable:

RESULT greedy_identical=<bool> speedup_vs_baseline=<x> speedup_vs_hf_assisted=<x>
       single_decoder_vs_hf_assisted=<x>
       tree_over_chain_accept_len=<x> acceptance=<accepted/drafted at gamma=4>
       tree_over_chain_accept_len_t1=<x> tree_over_chain_tok_s_t1=<x>
       tree_over_chain_accept_len_weak_t1=<x>
       dspark_tau_over_chain=<x> dspark_tau_over_chain_t1=<x>                 (one line)

greedy_identical covers every greedy method of ours: the eager ones against HF greedy, the
compiled ones against the compiled target's own greedy (`ours_engine_plain`; the compiled and
eager targets agree on the held-out text, bench/serving.py's compiled_token_agreement). Both
speedups time the served engine's gamma-4 draft-model chain with a constant schedule
(`ours_engine_draft_model`: policy off, every step drafts gamma), like the HF assisted run it is
compared with; the eager one-at-a-time decoder's ratio is printed beside them
(`single_decoder_vs_hf_assisted`).
tree_over_chain_accept_len is greedy at `--node-budget` (8) on the demo pair; the _t1 keys are
temperature 1.0 at budget 16, on the demo pair and (_weak_) on the weak draft.
The dspark keys: the DSpark drafter's accepted length tau (with the bonus token) over the
draft-model chain's at the same block (the checkpoint's block size), greedy and at T = 1, when the demo
target has a DSpark checkpoint (`--dspark`, default MODEL_DIR/demo-target-dspark; `manage.py
train_dspark` or the demo build's last phase writes it); absent otherwise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import zlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference.engine import (  # noqa: E402
    DraftConfig,
    GenerationConfig,
    GenerationStats,
    SpeculativeDecoder,
    build_drafter,
    generate_plain,
)
from bench.common import ROOT, load_pair_dirs  # noqa: E402

# (prompt, pass index) -> (generated ids, stats); a sampled method draws new seeds each pass
Runner = Callable[[list[int], int], tuple[list[int], GenerationStats | None]]


@dataclass
class Method:
    """One way to generate, its outputs on every prompt and its timings."""

    name: str
    run: Runner
    ours: bool = True
    greedy: bool = True
    compiled: bool = False  # runs the compiled target, whose own greedy output is its reference
    outputs: list[list[int]] = field(default_factory=list)
    tokens_per_second: list[float] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)

    def measure(self, prompts: list[list[int]], sync: Callable[[], None], index: int) -> None:
        """Time pass `index` over all prompts; keep its outputs.

        Greedy passes are identical, so their counters are the last pass's; each sampled pass
        draws new seeds, so its counters add to the earlier passes' (more draws, a steadier mean
        accepted length for the same run time).
        """
        outputs, tokens, stats = [], 0, GenerationStats()
        started = time.perf_counter()
        for prompt in prompts:
            generated, generation_stats = self.run(prompt, index)
            outputs.append(generated)
            tokens += len(generated)
            if generation_stats is not None:
                stats.merge(generation_stats)
        sync()
        self.tokens_per_second.append(tokens / (time.perf_counter() - started))
        if not self.greedy and self.tokens_per_second[1:]:
            stats.merge(self.stats)
        self.outputs, self.stats = outputs, stats

    @property
    def median_tps(self) -> float:
        return statistics.median(self.tokens_per_second)


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E = (1 - a^(g+1)) / (1 - a): tokens per step for i.i.d. acceptance a and draft length g."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def load_pair(args: argparse.Namespace):
    """Target, draft and tokenizer through the same loading path as production."""
    target_dir = Path(args.target or Path(args.model_dir) / "demo-target")
    draft_dir = Path(args.draft or Path(args.model_dir) / "demo-draft")
    target, draft = load_pair_dirs(target_dir, draft_dir, device=args.device)
    return target.model, draft.model, target.tokenizer


def load_weak_draft(args: argparse.Namespace, draft):
    """The weak draft (built and cached on first use), on the demo draft's device."""
    from bench.weak_draft import build_weak_draft
    from inference.engine.lm.loading import load_causal_lm

    directory = build_weak_draft(Path(args.model_dir), args.weak_steps,
                                 threads=max(1, torch.get_num_threads()),
                                 corpus_chars=args.weak_corpus_chars)
    return load_causal_lm(directory, device=args.device).model.to(draft.dtype)


def load_prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    path = Path(args.prompts_file or Path(args.model_dir) / "heldout_prompts.json")
    if not path.is_file():
        sys.exit(f"error: no held-out prompts at {path}")
    from inference.demo.prompts import load_heldout_prompts

    texts = load_heldout_prompts(path)[: args.prompts]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def hf_runner(target, eos: int | None, max_new: int, assistant=None) -> Runner:
    def run(prompt: list[int], index: int = 0) -> tuple[list[int], None]:
        input_ids = torch.tensor([prompt], device=target.device)
        with torch.inference_mode():
            output = target.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new,
                do_sample=False, eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
                assistant_model=assistant)
        return output[0, len(prompt):].tolist(), None
    return run


def ours_runner(target, drafter, generation: GenerationConfig) -> Runner:
    """Greedy as given; a sampled config gets a seed of its own per prompt and pass (the same for
    every method)."""
    decoder = SpeculativeDecoder(target, drafter)

    def run(prompt: list[int], index: int = 0) -> tuple[list[int], GenerationStats]:
        config = generation
        if not generation.greedy:
            config = replace(generation, seed=zlib.crc32(repr(prompt).encode()) + index)
        result = decoder.generate(prompt, config)
        return result.token_ids, result.stats
    return run


def served_engine(target, draft, store: Path, depth: int | None, compile_mode: str = "auto"):
    """The batched engine a worker runs, one row, on its compiled path with every package built
    (`compile_mode` off: its eager path); `depth`: every step drafts that many tokens (the policy
    off: a constant schedule, as HF assisted's), None: no draft model (plain decoding)."""
    from bench.serving_paths import compiled_engine
    from inference.engine.batch.engine import BatchedSpeculativeEngine
    from inference.engine.batch.policy import SpeculationPolicy

    policy = SpeculationPolicy(max_depth=depth, enabled=False) if depth else None
    draft = draft if depth else None
    if compile_mode == "off":
        return BatchedSpeculativeEngine(target, draft, policy=policy, max_rows=1)
    engine, seconds = compiled_engine(target, draft, store, policy=policy, max_rows=1)
    print(f"served engine ({'gamma ' + str(depth) if depth else 'plain'}): compiled forwards ready in "
          f"{seconds:.1f} s ({store})", flush=True)
    return engine


def engine_runner(engine, generation: GenerationConfig, drafter: str, gamma: int) -> Runner:
    """One request at a time through the served engine (batch 1)."""
    from inference.engine.batch.engine import BatchRequest

    def run(prompt: list[int], index: int = 0) -> tuple[list[int], GenerationStats]:
        request = BatchRequest(("bench", index), prompt, generation, drafter, DraftConfig(length=max(gamma, 1)))
        result = engine.run([request])[request.request_id]
        return result.token_ids, result.stats
    return run


def configure_assistant(draft, gamma: int) -> None:
    """HF assisted generation with a constant draft length and no early stop on confidence."""
    draft.generation_config.num_assistant_tokens = gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0


def mode_name(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"t{temperature:g}"


def shape_name(pair: str, shape: str, budget: int, temperature: float) -> str:
    """The name of one tree-vs-chain method, e.g. `weak_tree16_t1`."""
    return f"{pair}_{shape}{budget}_{mode_name(temperature)}"


def load_dspark_checkpoint(args: argparse.Namespace, target):
    """The demo target's DSpark drafter, or None (with a note) when it has none."""
    directory = Path(args.dspark or Path(args.model_dir) / "demo-target-dspark")
    if not (directory / "config.json").is_file():
        print(f"no DSpark checkpoint at {directory}: the dspark methods are skipped")
        return None
    from inference.engine.drafters.dspark import load_dspark

    return load_dspark(directory, target)


def dspark_vs_chain(by_name: dict[str, Method], temperature: float) -> float | None:
    """DSpark's mean accepted length (bonus included) over the chain's at the same block."""
    dspark, chain = by_name.get(f"dspark_{mode_name(temperature)}"), by_name.get(f"dspark_chain_{mode_name(temperature)}")
    if dspark is None or chain is None or not chain.stats.steps:
        return None
    return dspark.stats.mean_accepted_length / chain.stats.mean_accepted_length


def build_methods(args, target, draft, eos, weak_draft=None, dspark=None) -> list[Method]:
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_id=eos)

    def ours(name: str, kind: str, pair_draft=draft, temperature: float = 0.0, **config) -> Method:
        drafter = build_drafter(kind, target=target, draft=pair_draft, config=DraftConfig(**config),
                                dspark=dspark)
        method_generation = replace(generation, temperature=temperature)
        return Method(name, ours_runner(target, drafter, method_generation),
                      greedy=temperature == 0)

    configure_assistant(draft, args.gamma)
    served_plain = served_engine(target, draft, args.compile_dir, None, args.engine_compile)
    served_chain = served_engine(target, draft, args.compile_dir, args.gamma, args.engine_compile)
    methods = [
        Method("hf_generate_greedy", hf_runner(target, eos, args.max_new_tokens), ours=False),
        Method("ours_plain_greedy", lambda p, index=0: (
            (r := generate_plain(target, p, generation)).token_ids, r.stats)),
        Method("ours_engine_plain", engine_runner(served_plain, generation, "none", 0), compiled=True),
        Method("hf_assisted", hf_runner(target, eos, args.max_new_tokens, draft), ours=False),
        Method("ours_engine_draft_model", engine_runner(served_chain, generation, "draft_model", args.gamma),
               compiled=True),
        ours("ours_draft_model", "draft_model", length=args.gamma),
        ours("ours_draft_model_adaptive", "draft_model", length=args.gamma, adaptive=True,
             min_length=1, max_length=2 * args.gamma),
        ours("ours_ngram", "ngram", length=args.gamma),
    ]
    if dspark is not None:
        for temperature in (0.0, 1.0):
            methods.append(ours(f"dspark_{mode_name(temperature)}", "dspark", temperature=temperature))
            methods.append(ours(f"dspark_chain_{mode_name(temperature)}", "draft_model", temperature=temperature,
                                length=dspark.block_size))
    pairs = [("demo", draft)] + ([("weak", weak_draft)] if weak_draft is not None else [])
    for pair, pair_draft in pairs:
        for temperature in args.temperatures:
            for budget in args.budgets:
                methods.append(ours(shape_name(pair, "chain", budget, temperature), "draft_model",
                                    pair_draft, temperature, length=budget))
                methods.append(ours(shape_name(pair, "tree", budget, temperature), "tree",
                                    pair_draft, temperature, tree_width=args.tree_width,
                                    tree_depth=args.tree_depth or budget, node_budget=budget))
    return methods


def tree_vs_chain(by_name: dict[str, Method], pair: str, budget: int,
                  temperature: float) -> tuple[float, float] | None:
    """(tree / chain mean accepted length, tree / chain tok/s), or None when not measured."""
    tree = by_name.get(shape_name(pair, "tree", budget, temperature))
    chain = by_name.get(shape_name(pair, "chain", budget, temperature))
    if tree is None or chain is None:
        return None
    return (tree.stats.mean_accepted_length / chain.stats.mean_accepted_length,
            tree.median_tps / chain.median_tps)


def print_tree_table(by_name: dict[str, Method], args) -> None:
    print(f"{'pair':5} {'mode':7} {'budget':>6} {'chain len':>9} {'tree len':>8} {'ratio':>6} "
          f"{'chain tok/s':>11} {'tree tok/s':>10} {'ratio':>6} {'chain alpha':>11}")
    for pair in ("demo", "weak"):
        for temperature in args.temperatures:
            for budget in args.budgets:
                ratios = tree_vs_chain(by_name, pair, budget, temperature)
                if ratios is None:
                    continue
                chain = by_name[shape_name(pair, "chain", budget, temperature)]
                tree = by_name[shape_name(pair, "tree", budget, temperature)]
                print(f"{pair:5} {mode_name(temperature):7} {budget:6d} "
                      f"{chain.stats.mean_accepted_length:9.2f} {tree.stats.mean_accepted_length:8.2f} "
                      f"{ratios[0]:6.2f} {chain.median_tps:11.1f} {tree.median_tps:10.1f} "
                      f"{ratios[1]:6.2f} {chain.stats.per_token_acceptance:11.3f}")


def _ratio_key(by_name: dict[str, Method], key: str, pair: str, budget: int, temperature: float,
               index: int) -> str:
    ratios = tree_vs_chain(by_name, pair, budget, temperature)
    return f" {key}={ratios[index]:.2f}" if ratios is not None else ""


def report(methods: list[Method], args) -> str:
    by_name = {method.name: method for method in methods}
    eager_reference = by_name["hf_generate_greedy"].outputs
    compiled_reference = by_name["ours_engine_plain"].outputs

    def reference_of(method: Method) -> list[list[int]]:
        return compiled_reference if method.compiled else eager_reference
    print(f"{'method':28} {'tok/s':>7} {'accept':>7} {'alpha':>6} {'len':>5} {'E':>5} "
          f"{'steps':>6} {'draft s':>8} {'verify s':>8} identical")
    for method in methods:
        stats = method.stats
        gamma = len(stats.drafted_per_position)
        alpha = stats.per_token_acceptance
        bound = expected_tokens_per_step(alpha, gamma) if stats.drafted else float("nan")
        identical = method.outputs == reference_of(method) if method.greedy else "(sampled)"
        print(f"{method.name:28} {method.median_tps:7.1f} {stats.acceptance_rate:7.3f} "
              f"{alpha:6.3f} {stats.mean_accepted_length:5.2f} {bound:5.2f} {stats.steps:6d} "
              f"{stats.draft_seconds:8.2f} {stats.verify_seconds:8.2f} {identical}")
    baseline_name = max(("hf_generate_greedy", "ours_plain_greedy", "ours_engine_plain"),
                        key=lambda name: by_name[name].median_tps)
    chain = by_name["ours_engine_draft_model"]
    speedup = chain.median_tps / by_name[baseline_name].median_tps
    vs_assisted = chain.median_tps / by_name["hf_assisted"].median_tps
    single_vs_assisted = by_name["ours_draft_model"].median_tps / by_name["hf_assisted"].median_tps
    tree_over_chain = tree_vs_chain(by_name, "demo", args.node_budget, 0.0)
    alpha = chain.stats.per_token_acceptance
    identical = all(method.outputs == reference_of(method) for method in methods if method.ours and method.greedy)
    same_as_eager = sum(a == b for a, b in zip(compiled_reference, eager_reference))
    print(f"the compiled target's greedy output equals HF greedy on {same_as_eager} of {len(eager_reference)} prompts")
    print(f"baseline={baseline_name} ({by_name[baseline_name].median_tps:.1f} tok/s); "
          f"draft_model gamma={args.gamma}: accepted/drafted={chain.stats.acceptance_rate:.3f}, "
          f"per-token alpha={alpha:.3f}, mean accepted length "
          f"{chain.stats.mean_accepted_length:.2f} vs E(alpha)={expected_tokens_per_step(alpha, args.gamma):.2f}; "
          f"acceptance by position {[round(a, 3) for a in chain.stats.acceptance_per_position]}")
    print_tree_table(by_name, args)
    # acceptance= is the conservative figure, accepted / drafted
    result = (f"RESULT greedy_identical={str(identical).lower()} speedup_vs_baseline={speedup:.2f} "
              f"speedup_vs_hf_assisted={vs_assisted:.2f} single_decoder_vs_hf_assisted={single_vs_assisted:.2f}")
    if tree_over_chain is not None:
        result += f" tree_over_chain_accept_len={tree_over_chain[0]:.2f}"
    result += f" acceptance={chain.stats.acceptance_rate:.3f}"
    result += _ratio_key(by_name, "tree_over_chain_accept_len_t1", "demo", 16, 1.0, 0)
    result += _ratio_key(by_name, "tree_over_chain_tok_s_t1", "demo", 16, 1.0, 1)
    result += _ratio_key(by_name, "tree_over_chain_accept_len_weak_t1", "weak", 16, 1.0, 0)
    for key, temperature in (("dspark_tau_over_chain", 0.0), ("dspark_tau_over_chain_t1", 1.0)):
        ratio = dspark_vs_chain(by_name, temperature)
        if ratio is not None:
            result += f" {key}={ratio:.2f}"
    return result


WEAK_STEPS = 20


def _ints(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item]


def _floats(text: str) -> list[float]:
    return [float(item) for item in text.split(",") if item]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=os.environ.get("SPECOPS_MODEL_DIR", "models"))
    parser.add_argument("--target", help="target model directory (default: MODEL_DIR/demo-target)")
    parser.add_argument("--draft", help="draft model directory (default: MODEL_DIR/demo-draft)")
    parser.add_argument("--prompts-file", help="default: MODEL_DIR/heldout_prompts.json")
    parser.add_argument("--prompts", type=int, default=12, help="how many held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4, help="chain draft length")
    parser.add_argument("--node-budget", type=int, default=8,
                        help="the budget of the greedy tree_over_chain_accept_len key")
    parser.add_argument("--budgets", type=_ints, default=[8, 16], help="tree vs chain node budgets")
    parser.add_argument("--temperatures", type=_floats, default=[0.0, 0.7, 1.0],
                        help="tree vs chain temperatures (0: greedy)")
    parser.add_argument("--weak-steps", type=int, default=WEAK_STEPS,
                        help="distillation steps of the weak draft (0: no weak pair)")
    parser.add_argument("--weak-corpus-chars", type=int, default=1_500_000,
                        help="characters of the training split the weak draft is distilled on")
    parser.add_argument("--tree-width", type=int, default=3, help="children per tree node at most")
    parser.add_argument("--tree-depth", type=int, default=0, help="default: the node budget")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (0: torch default); 1 is steadiest on a shared 2-core box")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dspark", help="DSpark checkpoint directory (default: MODEL_DIR/demo-target-dspark)")
    parser.add_argument("--compile-dir", type=Path, default=ROOT / "var" / "compiled",
                        help="where the served engine's compiled forwards are built and found "
                             "(SPECOPS_COMPILE_DIR of the workers)")
    parser.add_argument("--engine-compile", choices=("auto", "off"), default="auto",
                        help="the served engine's forward path (off: eager, e.g. a quick check of the bench)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target, draft, tokenizer = load_pair(args)
    prompts = load_prompts(args, tokenizer)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    weak_draft = load_weak_draft(args, draft) if args.weak_steps else None
    dspark = load_dspark_checkpoint(args, target)
    methods = build_methods(args, target, draft, tokenizer.eos_token_id, weak_draft, dspark)
    print(f"device={args.device} threads={torch.get_num_threads()} prompts={len(prompts)} "
          f"max_new_tokens={args.max_new_tokens} gamma={args.gamma} node_budget={args.node_budget} "
          f"budgets={args.budgets} temperatures={args.temperatures} tree_width={args.tree_width} "
          f"weak_steps={args.weak_steps} repeats={args.repeats}")
    for method in methods:  # warm-up: allocator, lazy inits, HF generation config caches
        method.run(prompts[0])
    for index in range(args.repeats):
        for method in methods:
            method.measure(prompts, sync, index)
    print(report(methods, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
