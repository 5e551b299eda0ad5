"""Serving benchmark: aggregate throughput and latency as concurrency grows, on the demo pair, one run.

    .venv/bin/python bench/serving.py [--device cpu|cuda] [--concurrency 1,4,8,16] [--requests 32] [--skip-api | --api-only]
                                      [--linear-kernels chosen|torch]

At each concurrency c, the same workload of `--requests` requests (32 held-out prompts, 64 new
tokens, greedy, EOS off so every request runs its full length) is served with c requests in
flight: c arrive together and each one that ends is replaced by the next (a closed loop, as
vLLM's `--max-concurrency`), by:
  (a) sequential   today's path before batching: one SpeculativeDecoder (draft model, gamma 4)
                   per request, one request at a time;
  (b) plain_batch  the batched engine with no speculation (drafter "none");
  (c) spec_batch   the batched engine with speculation and its scheduler on, with each drafter
                   the target has (`spec_<drafter>`: draft_model, ngram, dspark when the target
                   has a DSpark checkpoint, and auto, where the policy picks); spec_batch is the
                   best of them at that concurrency;
  (d) hf_static    Hugging Face `model.generate` on left-padded batches of c prompts, one
                   batch after another (static batching), the outside reference;
  (e) hf_compiled  (c = 1) transformers' own StaticCache + torch.compile greedy loop
                   (bench/hf_compiled.py), the outside reference for a compiled decode.
The batched methods run on both forward paths (bench/serving_paths.py): the compiled one under
their names (plain_batch, spec_*: whole-model compiled forwards on static KV pools, the
packages built before timing, into --compile-dir) and the eager one as `<name>_eager`.
Aggregate tok/s = all tokens / wall time; TTFT = time from arrival to a request's first token;
ITL = per-token gap between a request's streamed steps (vLLM's definition; HF static gives
only its total, so its TTFT/ITL columns are empty). Then end to end through the API with a
real Celery worker (threads pool, the batching loop feeding its engine-core process) and an
async client: aggregate tok/s, TTFT and ITL at 1 and 8 concurrent requests, beside the engine's
own on the same workload. Each figure is measured in this run, so ratios compare like with like.

Before it, `CEILING batch8_over_sequential=<x> ours_over_hf_batch8=<x>`: the most those two
ratios could be in this run, the batched engine's ideal at c=8 (its forwards as measured in the
run, nothing between them, bench/serving_ceiling.py) over the baselines as measured.
Last line:
RESULT batch8_over_sequential=<x> spec_over_plain_batch1=<x> spec_over_plain_batch8=<x>
       ours_over_hf_batch8=<x> greedy_identical_batched=<bool> api_concurrency8_over_1=<x>
       spec_over_plain_batch16=<x> dspark_tau_over_chain_t1=<x>
       api_over_engine_batch1=<x> api_over_engine_batch8=<x>
       compiled_over_eager_plain_c1=<x> compiled_over_eager_spec_c1=<x> compiled_over_eager_spec_c8=<x>
       ours_plain_c1_over_hf_compiled=<x> worker_ready_s_cached=<s>
compiled_over_eager_*: the compiled path's tok/s over the eager path's, same method and c;
greedy_identical_batched: every compiled run equals the compiled target's own greedy output
(plain decoding one request at a time) and every eager run the one-at-a-time decoder's;
worker_ready_s_cached: an engine-core process from its start to its first compiled step with
the packages built (bench/worker_ready.py); compiled_token_agreement: the share of positions of
the held-out texts (256 tokens each, teacher-forced) where the compiled target's argmax is the
eager target's.
api_over_engine_batchC: the API's tok/s at c concurrent over the batched engine's own on the same
workload in this process (its torch threads those of the worker, OMP_NUM_THREADS, default 1).
dspark_tau_over_chain_t1: DSpark's accepted length (bonus token included) over the draft-model
chain's at the same block, T = 1, one-at-a-time over the prompts (absent without a checkpoint).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.engine import (  # noqa: E402
    DraftConfig,
    GenerationConfig,
    SpeculativeDecoder,
    build_drafter,
)
from inference.engine.batch.engine import BatchedSpeculativeEngine  # noqa: E402
from inference.engine.batch.policy import SpeculationPolicy  # noqa: E402
from inference.worker.metrics import inter_token_gaps  # noqa: E402
from bench.closed_loop import Run, percentile, run_batched  # noqa: E402
from bench.common import ADMIN_URL, load_demo_pair, require_demo_pair  # noqa: E402
from bench.serving_paths import (  # noqa: E402
    COMPILED_SUFFIX,
    EAGER_SUFFIX,
    compiled_engine,
    run_hf_compiled,
    token_agreement,
    worker_ready_seconds,
)

NO_EOS = ()


def run_sequential(target, draft, prompts, generation, gamma, concurrency: int = 1) -> Run:
    """One request at a time; request i arrives when request i - concurrency finished."""
    run = Run("sequential", concurrency)
    started = time.perf_counter()
    finished: list[float] = []
    for index, prompt in enumerate(prompts):
        arrival = started if index < concurrency else finished[index - concurrency]
        decoder = SpeculativeDecoder(target, build_drafter("draft_model", target=target, draft=draft,
                                                           config=DraftConfig(length=gamma)))
        times, counts, tokens = [], [], []
        for step in decoder.stream(prompt, generation):
            times.append(time.perf_counter())
            counts.append(len(step.token_ids))
            tokens.extend(step.token_ids)
        finished.append(times[-1])
        run.outputs.append(tokens)
        run.ttft.append(times[0] - arrival)
        run.itl.extend(inter_token_gaps(times, counts))
    run.seconds = time.perf_counter() - started
    return run


def run_hf_static(target, tokenizer, prompts, max_new_tokens, concurrency: int | None = None) -> Run:
    """Static batching: the prompts in left-padded batches of `concurrency`, one after another."""
    concurrency = concurrency or len(prompts)
    run = Run("hf_static", concurrency)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    started = time.perf_counter()
    for start in range(0, len(prompts), concurrency):
        batch = prompts[start:start + concurrency]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=target.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                                 device=target.device)
        with torch.inference_mode():
            output = target.generate(input_ids=input_ids, attention_mask=attention, do_sample=False,
                                     max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                     pad_token_id=pad, eos_token_id=None)
        run.outputs.extend(row[width:].tolist() for row in output)
    run.seconds = time.perf_counter() - started
    return run


def spec_drafters(args, dspark) -> list[str]:
    """The drafters the spec_batch runs compare: those asked for that this target can run."""
    wanted = [name.strip() for name in args.drafters.split(",") if name.strip()]
    return [name for name in wanted if name != "dspark" or dspark is not None]


def load_dspark_checkpoint(args, target):
    directory = Path(args.dspark or Path(args.model_dir) / "demo-target-dspark")
    if not (directory / "config.json").is_file():
        print(f"  no DSpark checkpoint at {directory}: dspark is not measured", flush=True)
        return None
    from inference.engine.drafters.dspark import load_dspark

    return load_dspark(directory, target)


def dspark_tau_over_chain(target, draft, dspark, prompts, max_new_tokens: int) -> float:
    """Mean accepted length (bonus included) of DSpark over the draft-model chain, same block, T = 1."""
    taus = []
    for kind in ("dspark", "draft_model"):
        decoder = SpeculativeDecoder(target, build_drafter(kind, target, draft, DraftConfig(length=dspark.block_size),
                                                           dspark=dspark))
        accepted = steps = 0
        for index, prompt in enumerate(prompts):
            decoder.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0, seed=index,
                                                      eos_token_id=NO_EOS))
            accepted, steps = accepted + decoder.stats.accepted, steps + decoder.stats.steps
        taus.append((accepted + steps) / max(steps, 1))
    return taus[0] / taus[1]


def engine_table(args, target, draft, tokenizer, prompts, dspark=None
                 ) -> tuple[dict[tuple[str, int], Run], list[float]]:
    """Every method at every concurrency; the batched ones on both forward paths (serving_paths.py):
    compiled under their own names, eager with `_eager` appended."""
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_id=NO_EOS)
    policy = SpeculationPolicy(max_depth=8)
    prefill = None if args.prefill == "auto" else args.prefill
    options = dict(decode=tokenizer.decode, max_rows=max(args.concurrency), prefill=prefill)
    spec_engine, spec_seconds = compiled_engine(target, draft, args.compile_dir, policy=policy, dspark=dspark,
                                                **options)
    plain_engine, plain_seconds = compiled_engine(target, draft, args.compile_dir, **options)
    print(f"  compiled forwards ready in {spec_seconds + plain_seconds:.1f} s "
          f"(built now, or found in {args.compile_dir})", flush=True)
    eager_policy = SpeculationPolicy(max_depth=8)
    eager_spec = BatchedSpeculativeEngine(target, draft, policy=eager_policy, dspark=dspark,
                                          pack_linear=args.pack_linear, **options)
    eager_plain = BatchedSpeculativeEngine(target, draft, **options)
    engines = {COMPILED_SUFFIX: (plain_engine, spec_engine), EAGER_SUFFIX: (eager_plain, eager_spec)}
    drafters = spec_drafters(args, dspark)
    # warm-up: every method once at a small batch, and the policy's cost model on real shapes
    warm = [prompts[0], prompts[1 % len(prompts)]]
    for plain, spec in engines.values():
        for drafter in drafters:
            run_batched("warm", spec, warm * 4, generation, drafter, args.gamma)
        run_batched("warm", plain, warm, generation, "none", args.gamma)
    run_sequential(target, draft, warm[:1], GenerationConfig(max_new_tokens=8, eos_token_id=NO_EOS),
                   args.gamma)
    run_hf_static(target, tokenizer, warm, 8)
    runs: dict[tuple[str, int], Run] = {}
    for c in args.concurrency:
        # the same workload at every concurrency: `requests` prompts, c of them in flight
        batch = [prompts[i % len(prompts)] for i in range(max(c, args.requests))]
        for _ in range(args.repeats):  # methods interleaved so load drifts hit them alike
            candidates = {
                "sequential": lambda: run_sequential(target, draft, batch, generation, args.gamma, c),
                "hf_static": lambda: run_hf_static(target, tokenizer, batch, args.max_new_tokens, c),
            }
            for suffix, (plain, spec) in engines.items():
                candidates[f"plain_batch{suffix}"] = (lambda plain=plain, suffix=suffix: run_batched(
                    f"plain_batch{suffix}", plain, batch, generation, "none", args.gamma, c))
                for drafter in drafters:
                    candidates[f"spec_{drafter}{suffix}"] = (lambda drafter=drafter, spec=spec, suffix=suffix: run_batched(
                        f"spec_{drafter}{suffix}", spec, batch, generation, drafter, args.gamma, c))
            for name, measure in candidates.items():
                if name == "sequential" and c > args.sequential_max:
                    continue
                run = measure()
                best = runs.get((name, c))
                if best is None or run.tokens_per_second > best.tokens_per_second:
                    runs[(name, c)] = run
        for suffix in engines:
            best = max((runs[(f"spec_{drafter}{suffix}", c)] for drafter in drafters),
                       key=lambda run: run.tokens_per_second)
            runs[(f"spec_batch{suffix}", c)] = best
        print(f"  c={c}: " + ", ".join(f"{name} {run.tokens_per_second:.0f} tok/s"
                                       for (name, at), run in runs.items() if at == c and not name.startswith("spec_batch"))
              + f"; spec_batch = {runs[('spec_batch', c)].method}, eager {runs[('spec_batch' + EAGER_SUFFIX, c)].method}",
              flush=True)
    if 1 in args.concurrency:
        runs[("hf_compiled", 1)] = run_hf_compiled(target, prompts[:max(1, min(len(prompts), args.requests))],
                                                   args.max_new_tokens)
        print(f"  hf_compiled c=1: {runs[('hf_compiled', 1)].tokens_per_second:.0f} tok/s", flush=True)
    rates = {kind: [round(t.rate(i), 2) for i in range(4)] for kind, t in policy.acceptance.items()}
    print(f"  policy: acceptance by position {rates}", flush=True)
    tracker = policy.acceptance.get("draft_model")
    acceptance = [tracker.rate(i) for i in range(8)] if tracker is not None else [0.8]
    return runs, acceptance


def print_table(runs: dict[tuple[str, int], Run]) -> None:
    print(f"{'method':<17} {'c':>3} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'ITL p50':>8} {'ITL p95':>8}   (ms)")

    def ms(value):
        return f"{value * 1000:.1f}" if value is not None else "-"
    for (name, c), run in sorted(runs.items(), key=lambda item: (item[0][1], item[0][0])):
        print(f"{name:<17} {c:>3} {run.tokens_per_second:>8.1f} {ms(percentile(run.ttft, .5)):>9} "
              f"{ms(percentile(run.ttft, .95)):>9} {ms(percentile(run.itl, .5)):>8} "
              f"{ms(percentile(run.itl, .95)):>8}")


def greedy_identical(runs: dict[tuple[str, int], Run], reference: dict[int, list[int]],
                     compiled_reference: dict[int, list[int]], prompts_for) -> bool:
    """Every batched output equals the same prompt's greedy output of the same target: the eager
    runs the one-at-a-time decoder's, the compiled runs the compiled target's own (plain
    decoding, one request at a time)."""
    identical = True
    for (name, c), run in runs.items():
        if not (name.startswith("plain_batch") or name.startswith("spec_")):
            continue
        expected = reference if name.endswith(EAGER_SUFFIX) else compiled_reference
        for index, output in enumerate(run.outputs):
            if output != expected[prompts_for(index)]:
                print(f"  MISMATCH {name} c={c} request {index}", flush=True)
                identical = False
                break
    return identical


def compiled_greedy_reference(args, target, draft, tokenizer, prompts, count: int) -> dict[int, list[int]]:
    """The compiled target's own greedy output per prompt: plain decoding, one request at a time."""
    engine, _ = compiled_engine(target, draft, args.compile_dir, decode=tokenizer.decode, max_rows=max(args.concurrency))
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_id=NO_EOS)
    run = run_batched("reference", engine, prompts[:count], generation, "none", args.gamma, 1)
    return dict(enumerate(run.outputs))


def print_ceiling(args, target, draft, acceptance: list[float], sequential_tps: float, hf_tps: float) -> None:
    """The most the c=8 ratios could be with this run's forwards and nothing else (serving_ceiling.py):
    the batched engine's ideal over the baselines as measured."""
    from bench.serving_ceiling import serving_ceiling

    ceiling = serving_ceiling(target, draft, args.prompt_tokens, args.max_new_tokens, max(8, args.requests), 8,
                              acceptance, gamma=args.gamma)
    print(f"  ceiling at c=8 (these forwards, no Python between them, prompts prefilled 8 at a time): "
          f"batched {ceiling.batch_tps:.0f} tok/s (depth {ceiling.batch_depth}, {ceiling.step_ms:.1f} ms a step); "
          f"the one-at-a-time decoder's the same way {ceiling.sequential_tps:.0f} tok/s", flush=True)
    print(f"CEILING batch8_over_sequential={ceiling.batch_tps / sequential_tps:.2f} "
          f"ours_over_hf_batch8={ceiling.batch_tps / hf_tps:.2f}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=os.environ.get("SPECOPS_MODEL_DIR", str(ROOT / "models")))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", default="1,4,8,16",
                        type=lambda text: [int(part) for part in text.split(",")])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=48, help="cut each prompt to this many tokens")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32,
                        help="requests served at each concurrency (at least c), c in flight at a time")
    parser.add_argument("--repeats", type=int, default=2, help="best of N per method and concurrency")
    parser.add_argument("--sequential-max", type=int, default=16)
    # One thread, as the workers run (OMP_NUM_THREADS=1 in scripts/run.sh and the systemd unit):
    # on a shared 2-core box a second intra-op thread spins against the other processes.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--prefill", choices=("auto", "shared", "separate"), default="auto",
                        help="the batched engines' prefill mode (SPECOPS_PREFILL of the API's worker)")
    parser.add_argument("--linear-kernels", choices=("chosen", "torch"), default="chosen",
                        help="the engine's linear products: oneDNN where measured exact and faster "
                             "(the workers' default, SPECOPS_ONEDNN_LINEAR), or torch's own everywhere")
    parser.add_argument("--skip-api", action="store_true", help="engine figures only")
    parser.add_argument("--drafters", default="draft_model,ngram,dspark,auto",
                        help="the drafters spec_batch compares (dspark only where a checkpoint exists)")
    parser.add_argument("--dspark", help="DSpark checkpoint (default: MODEL_DIR/demo-target-dspark)")
    parser.add_argument("--pack-linear", action="store_true",
                        help="spec_batch's engine packs its linear layers (SPECOPS_PACK_LINEAR)")
    parser.add_argument("--compile-dir", type=Path, default=ROOT / "var" / "compiled",
                        help="where the compiled forwards are built and found (SPECOPS_COMPILE_DIR of the workers)")
    parser.add_argument("--api-only", action="store_true",
                        help="the API figures only (c=1 and c=8; no engine table, no RESULT line)")
    parser.add_argument("--api-requests", type=int, default=16)
    parser.add_argument("--admin-url", default=ADMIN_URL,
                        help="where the API run makes (and drops) its own database, specops_bench_serving")
    parser.add_argument("--redis-db", type=int, default=7,
                        help="the API run's own Redis database (broker, cache, streams), flushed first")
    return parser.parse_args(argv)


def measure_api(model_dir: Path, args: argparse.Namespace, target=None, draft=None) -> dict[str, float]:
    """tok/s through the API at 1 and 8 concurrent requests, and the engine's own on the same
    workload in this process (bench/serving_api.py): the API's ratios."""
    from bench.serving_api import api_throughput, engine_throughput

    if target is None:
        target, draft = load_demo_pair(model_dir, args.device)
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))  # the worker's core runs with these
    engine = engine_throughput(target, draft, [1, 8], args.api_requests, args.max_new_tokens, threads)
    for c, measure in engine.items():
        print(f"  engine alone ({threads} torch thread(s)), c={c}: {measure.describe()}", flush=True)
    api = api_throughput(model_dir, [1, 8], args.api_requests, args.max_new_tokens, args.admin_url,
                         args.redis_db)
    for c, measure in api.items():
        print(f"  API end to end, c={c}: {measure.describe()}", flush=True)
    return {"api_concurrency8_over_1": api[8].tokens_per_second / api[1].tokens_per_second,
            "api_over_engine_batch1": api[1].tokens_per_second / engine[1].tokens_per_second,
            "api_over_engine_batch8": api[8].tokens_per_second / engine[8].tokens_per_second}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.prefill != "auto":
        os.environ["SPECOPS_PREFILL"] = args.prefill  # the API run's worker inherits it
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.linear_kernels == "torch":
        from inference.engine.lm.linear_kernels import LinearKernels, set_linear_kernels

        set_linear_kernels(LinearKernels(enabled=False))
        os.environ["SPECOPS_ONEDNN_LINEAR"] = "false"  # the API run's worker inherits it
    from inference.demo.prompts import load_heldout_prompts

    model_dir = Path(args.model_dir)
    require_demo_pair(model_dir)
    if args.api_only:
        api = measure_api(model_dir, args)
        print("API " + " ".join(f"{key}={value:.2f}" for key, value in api.items()))
        return 0
    target, draft = load_demo_pair(model_dir, args.device)
    tokenizer = target.tokenizer
    texts = load_heldout_prompts(model_dir / "heldout_prompts.json")
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"][: args.prompt_tokens]
               for text in texts]
    print(f"serving bench: demo pair on {args.device}, {len(prompts)} prompts, "
          f"{args.max_new_tokens} new tokens, torch threads {torch.get_num_threads()}, "
          f"linear kernels {args.linear_kernels}", flush=True)
    dspark = load_dspark_checkpoint(args, target.model)
    runs, acceptance = engine_table(args, target.model, draft.model, tokenizer, prompts, dspark)
    print_table(runs)
    # the one-at-a-time decoder's output per prompt is the reference for greedy identity
    reference = {}
    for c in args.concurrency:
        run = runs.get(("sequential", c))
        if run is not None:
            for index, output in enumerate(run.outputs):
                reference.setdefault(index % len(prompts), output)
    served = max(max(args.concurrency), args.requests)
    missing = [i for i in range(min(len(prompts), served)) if i not in reference]
    if missing:
        generation = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_id=NO_EOS)
        extra = run_sequential(target.model, draft.model, [prompts[i] for i in missing], generation,
                               args.gamma)
        reference.update(dict(zip(missing, extra.outputs)))
    compiled_reference = compiled_greedy_reference(args, target.model, draft.model, tokenizer, prompts,
                                                   min(len(prompts), served))
    identical = greedy_identical(runs, reference, compiled_reference, lambda index: index % len(prompts))

    def tps(name, c):
        run = runs.get((name, c))
        return run.tokens_per_second if run else float("nan")

    if 8 in args.concurrency:
        print_ceiling(args, target.model, draft.model, acceptance, tps("sequential", 8), tps("hf_static", 8))
    api = {"api_concurrency8_over_1": float("nan")}
    if not args.skip_api:
        api = measure_api(model_dir, args, target, draft)
    compiled = {
        "compiled_over_eager_plain_c1": tps("plain_batch", 1) / tps("plain_batch" + EAGER_SUFFIX, 1),
        "compiled_over_eager_spec_c1": tps("spec_batch", 1) / tps("spec_batch" + EAGER_SUFFIX, 1),
        "compiled_over_eager_spec_c8": tps("spec_batch", 8) / tps("spec_batch" + EAGER_SUFFIX, 8),
        "ours_plain_c1_over_hf_compiled": tps("plain_batch", 1) / tps("hf_compiled", 1),
        "worker_ready_s_cached": worker_ready_seconds(model_dir, args.compile_dir, args.threads or 1),
        "compiled_token_agreement": token_agreement(target.model, args.compile_dir,
                                                    [tokenizer(text, add_special_tokens=False)["input_ids"][:256]
                                                     for text in texts]),
    }
    print(f"RESULT batch8_over_sequential={tps('spec_batch', 8) / tps('sequential', 8):.2f} "
          f"spec_over_plain_batch1={tps('spec_batch', 1) / tps('plain_batch', 1):.2f} "
          f"spec_over_plain_batch8={tps('spec_batch', 8) / tps('plain_batch', 8):.2f} "
          f"ours_over_hf_batch8={tps('spec_batch', 8) / tps('hf_static', 8):.2f} "
          f"greedy_identical_batched={str(identical).lower()} "
          + " ".join(f"{key}={value:.2f}" for key, value in api.items())
          + (f" spec_over_plain_batch16={tps('spec_batch', 16) / tps('plain_batch', 16):.2f}"
             if 16 in args.concurrency else "")
          + (f" dspark_tau_over_chain_t1={dspark_tau_over_chain(target.model, draft.model, dspark, prompts[:8], args.max_new_tokens):.2f}"
             if dspark is not None else "")
          + " " + " ".join(f"{key}={value:.2f}" for key, value in compiled.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
