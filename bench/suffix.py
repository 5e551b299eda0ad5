"""Suffix drafter benchmark: a repetitive workload, suffix vs n-gram vs draft model vs none, one run.

    .venv/bin/python bench/suffix.py [--model-dir models] [--requests 120] [--max-new-tokens 40]

Workload: `--requests` requests that regenerate variants of the same functions: `--bases`
held-out demo prompts (function openings the demo pair never trained on), each asked again and
again as is, with the function renamed, or with its first parameter renamed throughout, in
round-robin order. Nothing is prepared for the drafter: its corpus starts empty and, as the
worker does, each finished request's prompt tail and output are added to it (one tenant's
corpus) before the next request runs, so it only knows what the workload itself produced.

Every request runs with every method in turn (methods interleaved per request, so load drifts
hit them alike) through the single-sequence SpeculativeDecoder, greedy: `none` (the target
alone, one token per step: the baseline), `ngram` (prompt lookup at the suffix drafter's draft
length and at 4; the better of the two is the n-gram figure), `draft_model` (the demo draft,
chain of 4) and `suffix`. tok/s counts generated tokens over the wall time of the method's own
generations; mean accepted length is tokens per step (accepted drafts plus the target's own
token, as in bench/engine.py). The last line:

RESULT suffix_over_ngram_repetitive=<x> suffix_over_none=<x> suffix_over_draft_model=<x>
       ngram_over_none=<x> draft_model_over_none=<x> suffix_accept_len=<x> ngram_accept_len=<x>
       greedy_identical=<bool>                                                      (one line)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference.engine import (  # noqa: E402
    DraftConfig,
    GenerationConfig,
    GenerationStats,
    SpeculativeDecoder,
    build_drafter,
)
from inference.engine.drafters.suffix import (  # noqa: E402
    SuffixCorpora,
    SuffixDrafter,
    finished_sequence,
)
from bench.common import load_demo_pair  # noqa: E402

_DEF = re.compile(r"def\s+([A-Za-z_]\w*)\s*\(\s*([A-Za-z_]\w*)?")
CORPUS = "bench-tenant"


@dataclass
class Method:
    """One drafter, its outputs and counters over the whole workload."""

    name: str
    decoder: SpeculativeDecoder
    seconds: float = 0.0
    tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    # the same counters over the requests after the first round (the corpus has seen each base)
    warm: GenerationStats = field(default_factory=GenerationStats)
    warm_seconds: float = 0.0
    warm_tokens: int = 0

    def run(self, prompt: list[int], generation: GenerationConfig, warm: bool) -> list[int]:
        started = time.perf_counter()
        result = self.decoder.generate(prompt, generation)
        seconds = time.perf_counter() - started
        self.seconds += seconds
        self.tokens += len(result.token_ids)
        self.stats.merge(result.stats)
        if warm:
            self.warm.merge(result.stats)
            self.warm_seconds += seconds
            self.warm_tokens += len(result.token_ids)
        self.outputs.append(result.token_ids)
        return result.token_ids

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def warm_tokens_per_second(self) -> float:
        return self.warm_tokens / self.warm_seconds if self.warm_seconds else 0.0


def variant(text: str, number: int) -> str:
    """Variant `number` of a function opening: as is, renamed, or its first parameter renamed."""
    kind = number % 3
    found = _DEF.search(text)
    if kind == 0 or found is None:
        return text
    if kind == 1:
        name = found.group(1)
        return text[:found.start(1)] + f"{name}_v{number}" + text[found.end(1):]
    parameter = found.group(2)
    if not parameter or parameter in ("self", "cls"):
        return text.replace("\n", f"  # variant {number}\n", 1)
    return re.sub(rf"\b{re.escape(parameter)}\b", f"{parameter}{number}", text)


def workload(texts: list[str], requests: int, tokenizer) -> list[tuple[int, list[int]]]:
    """(base index, prompt ids) of each request: the bases in round-robin, variant by variant."""
    prompts = []
    for index in range(requests):
        base = index % len(texts)
        text = variant(texts[base], index // len(texts))
        prompts.append((base, tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def load_texts(args: argparse.Namespace) -> list[str]:
    path = Path(args.model_dir) / "heldout_prompts.json"
    if not path.is_file():
        sys.exit(f"error: no held-out prompts at {path}")
    from inference.demo.prompts import load_heldout_prompts

    texts = load_heldout_prompts(path)
    if len(texts) < args.bases:
        sys.exit(f"error: {path} holds {len(texts)} prompts; --bases {args.bases} needs more")
    return texts[: args.bases]


def build_methods(args, target, draft, corpora: SuffixCorpora) -> list[Method]:
    def ours(name: str, kind: str, **config) -> Method:
        drafter = build_drafter(kind, target=target, draft=draft, config=DraftConfig(**config))
        return Method(name, SpeculativeDecoder(target, drafter))

    suffix = SuffixDrafter(DraftConfig(length=args.length, node_budget=args.node_budget),
                           corpus=CORPUS, corpora=corpora)
    return [
        ours("none", "none"),
        ours(f"ngram_{args.length}", "ngram", length=args.length),
        ours("ngram_4", "ngram", length=4),
        ours("draft_model_4", "draft_model", length=4),
        Method("suffix", SpeculativeDecoder(target, suffix)),
    ]


def report(methods: list[Method], corpora: SuffixCorpora, args) -> str:
    by_name = {method.name: method for method in methods}
    reference = by_name["none"].outputs
    print(f"{'method':16} {'tok/s':>7} {'x none':>7} {'accept len':>10} {'accepted/drafted':>16} "
          f"{'steps':>6} {'warm tok/s':>10} {'warm len':>8} identical")
    baseline = by_name["none"].tokens_per_second
    for method in methods:
        stats = method.stats
        print(f"{method.name:16} {method.tokens_per_second:7.1f} "
              f"{method.tokens_per_second / baseline:7.2f} {stats.mean_accepted_length:10.2f} "
              f"{stats.acceptance_rate:16.3f} {stats.steps:6d} {method.warm_tokens_per_second:10.1f} "
              f"{method.warm.mean_accepted_length:8.2f} {method.outputs == reference}")
    ngram = max((by_name[f"ngram_{args.length}"], by_name["ngram_4"]),
                key=lambda method: method.tokens_per_second)
    suffix, draft = by_name["suffix"], by_name["draft_model_4"]
    index = corpora.index(CORPUS)
    print(f"n-gram figure: {ngram.name}; suffix corpus at the end: {len(index)} sequences, "
          f"{index.token_count} tokens, {index.key_count} anchors; 'warm' = requests after the "
          f"first {args.bases} (each base seen once)")
    identical = all(method.outputs == reference for method in methods)
    return (f"RESULT suffix_over_ngram_repetitive={suffix.tokens_per_second / ngram.tokens_per_second:.2f} "
            f"suffix_over_none={suffix.tokens_per_second / baseline:.2f} "
            f"suffix_over_draft_model={suffix.tokens_per_second / draft.tokens_per_second:.2f} "
            f"ngram_over_none={ngram.tokens_per_second / baseline:.2f} "
            f"draft_model_over_none={draft.tokens_per_second / baseline:.2f} "
            f"suffix_accept_len={suffix.stats.mean_accepted_length:.2f} "
            f"ngram_accept_len={ngram.stats.mean_accepted_length:.2f} "
            f"greedy_identical={str(identical).lower()}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=os.environ.get("SPECOPS_MODEL_DIR", "models"))
    parser.add_argument("--requests", type=int, default=120,
                        help="the issue asks for 200; 120 keeps a run to minutes on a 2-core CPU")
    parser.add_argument("--bases", type=int, default=10, help="distinct held-out prompts varied")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--length", type=int, default=8, help="suffix (and n-gram) draft length")
    parser.add_argument("--node-budget", type=int, default=8, help="suffix tree nodes per step")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (0: torch default); 1 is steadiest on a shared 2-core box")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target, draft = load_demo_pair(Path(args.model_dir), args.device)
    prompts = workload(load_texts(args), args.requests, target.tokenizer)
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_id=target.tokenizer.eos_token_id)
    corpora = SuffixCorpora()
    methods = build_methods(args, target.model, draft.model, corpora)
    print(f"device={args.device} threads={torch.get_num_threads()} requests={len(prompts)} "
          f"bases={args.bases} max_new_tokens={args.max_new_tokens} length={args.length} "
          f"node_budget={args.node_budget}")
    warm_up = target.tokenizer("def warm_up(x):\n    ", add_special_tokens=False)["input_ids"]
    for method in methods:  # allocator and lazy inits; the suffix corpus stays empty
        method.decoder.generate(warm_up, GenerationConfig(max_new_tokens=8))
    started = time.perf_counter()
    for number, (_, prompt) in enumerate(prompts):
        warm = number >= args.bases
        for method in methods:
            output = method.run(prompt, generation, warm)
        corpora.add(CORPUS, finished_sequence(prompt, output))  # as the worker does when it succeeds
        if (number + 1) % 20 == 0:
            print(f"  {number + 1}/{len(prompts)} requests, {time.perf_counter() - started:.0f} s",
                  flush=True)
    print(report(methods, corpora, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
