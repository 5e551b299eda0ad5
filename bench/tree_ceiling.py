"""How far can a lossless tree beat a chain of the same node budget? Exact per-position rates and a bound.

    .venv/bin/python bench/tree_ceiling.py [--model-dir models] [--weak-steps 20] [--prompts 16]

On the positions a sampled (temperature 1.0) generation actually visits — the target samples a
continuation of each held-out prompt, and the target's p and the draft's q are read at every
position of it — this computes, exactly from p and q rather than by sampling:

  chain     the chance a draft token drawn from q is accepted: sum min(p, q) = 1 - TV(p, q);
  rrs_2     the chance that one of 2 siblings drawn from q without replacement is accepted by
            recursive rejection (what the tree drafter does: the second is judged by the
            residual the first left), exactly;
  bound_k   an upper bound for ANY lossless verification of k siblings drawn from q without
            replacement: the accepted token is the target's own sample Y ~ p, so the best chance
            is the largest coupling of the siblings with Y: for k = 2 exactly 1 - max over
            token sets R of [P(both siblings in R) - p(R)] (max-flow/min-cut), for k = 3 the
            looser sum_x min(p(x), P(x is among the siblings));
  topk      k siblings that are q's k most likely tokens (no sampling), verified exactly by
            sampling Y ~ p and keeping it when it is a sibling: sum of p over them.

Then the best tree of `--budget` nodes under each rule's average rates (best-first over path
values: a node's value is its parent's times the rate of its rank among siblings; the chain
is the tree with one child per node) against the chain of the same budget, in expected
accepted tokens per step (the target's own token included), as bench/engine.py reports them.
The `bound` rows are a ceiling: no verification of siblings drawn from this draft can do
better than them on these positions. Last line:

RESULT tree_over_chain_rrs_weak_t1=<x> tree_over_chain_bound_weak_t1=<x> tree_over_chain_topk_weak_t1=<x>
       tree_over_chain_rrs_demo_t1=<x> tree_over_chain_bound_demo_t1=<x>
"""

from __future__ import annotations

import argparse
import heapq
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import require_demo_pair  # noqa: E402

MAX_SIBLINGS = 3


def position_rates(p: torch.Tensor, q: torch.Tensor) -> dict[str, list[float]]:
    """Acceptance of the first 1..MAX_SIBLINGS siblings at one position, cumulative, per rule.

    p, q: [vocab] the target's and the draft's distributions at this position.
    """
    p, q = p.double(), q.double()
    chain = float(torch.minimum(p, q).sum())
    rates = {"rrs": [chain], "bound": [chain], "topk": []}
    # recursive rejection without replacement, exact for two siblings: after the first (x1, drawn
    # from q) is rejected, the target residual is r1 = norm(max(p - q, 0)) and x1 is distributed as
    # w = norm(max(q - p, 0)); the second is drawn from q without x1, i.e. c * q with
    # c = 1 / (1 - q(x1)) off x1, and accepted with sum_x min(r1(x), c q(x)) (r1(x1) = 0): one
    # sort of r1 / q and a search per x1
    r1 = torch.clamp(p - q, min=0)
    rejected = torch.clamp(q - p, min=0)
    if float(r1.sum()) > 0 and float(rejected.sum()) > 0:
        r1, w = r1 / r1.sum(), rejected / rejected.sum()
        ratio = torch.where(q > 0, r1 / q.clamp_min(1e-300), torch.inf)
        order = torch.argsort(ratio)
        below_r, below_q = torch.cumsum(r1[order], 0), torch.cumsum(q[order], 0)
        scale = 1.0 / (1.0 - q).clamp_min(1e-12)
        at = torch.searchsorted(ratio[order], scale, right=True)
        taken = (at - 1).clamp_min(0)
        accept = torch.where(at > 0, below_r[taken] + scale * (1 - below_q[taken]), scale)
        rates["rrs"].append(chain + (1 - chain) * float((w * accept.clamp(max=1.0)).sum()))
    else:
        rates["rrs"].append(chain)
    # P(x among the k siblings drawn without replacement), exact for k = 2 and, over the first
    # sibling's 256 likeliest values (the rest of its mass taken as leaving q unchanged), for k = 3
    rates["bound"].append(_optimal_two(p, q))
    if MAX_SIBLINGS >= 3:
        firsts = torch.topk(q, min(256, q.numel())).indices
        included3 = q.clone()  # x drawn first
        covered = 0.0
        for y in firsts.tolist():
            rest = q.clone()
            rest[y] = 0
            rest = rest / rest.sum()
            two = _included_in_two(rest)
            two[y] = 0
            included3 += q[y] * two
            covered += float(q[y])
        tail = max(1.0 - covered, 0.0)
        included3 += tail * _included_in_two(q) * (1 - q)  # a tail first sibling, x not it
        rates["bound"].append(float(torch.minimum(p, included3.clamp(max=1.0)).sum()))
    ranked = torch.argsort(q, descending=True)[:MAX_SIBLINGS]
    rates["topk"] = torch.cumsum(p[ranked], dim=0).tolist()
    return rates


def _included_in_two(q: torch.Tensor) -> torch.Tensor:
    """[vocab] P(x is one of two draws without replacement from q) = q(x) (1 + sum_{y != x} q(y) / (1 - q(y)))."""
    ratio = q / (1 - q).clamp_min(1e-12)
    return (q * (1 + ratio.sum() - ratio)).clamp(max=1.0)


def _optimal_two(p: torch.Tensor, q: torch.Tensor) -> float:
    """The best acceptance any lossless rule can get from two siblings drawn from q without replacement.

    Accepting means the target's sample Y ~ p is one of the siblings; the largest chance over all
    couplings of (siblings, Y) is, by max-flow/min-cut on the bipartite graph sibling pairs ->
    tokens, 1 - max over token sets R of [P(both siblings in R) - p(R)]. The maximising R is taken
    among the sets of tokens the draft over-proposes most (prefixes by q/p, Hu et al. 2025); any
    other R could only lower the bound further, so the value is an upper bound either way.
    P(both in R) = sum_{y in R} q(y) (q(R) - q(y)) / (1 - q(y)), with running sums over prefixes.
    """
    order = torch.argsort(q / p.clamp_min(1e-30), descending=True)
    qs, ps = q[order], p[order]
    ratio = qs / (1 - qs).clamp_min(1e-12)
    q_r = torch.cumsum(qs, 0)
    both = q_r * torch.cumsum(ratio, 0) - torch.cumsum(qs * ratio, 0)
    gap = both - torch.cumsum(ps, 0)
    return float(1.0 - max(float(gap.max()), 0.0))


def best_tree(rank_rates: list[float], budget: int, max_width: int) -> float:
    """Expected accepted tokens per step of the best `budget`-node tree (target's token included).

    rank_rates[j]: the chance that sibling j (0-based) is the accepted one (rates per rank, not
    cumulative). A node's value is the probability that its whole path is accepted.
    """
    total = 1.0
    # (negative value, depth, rank) of the candidate nodes; children of the root first
    frontier = [(-rank_rates[0], 0)]
    heapq.heapify(frontier)
    used = 0
    while frontier and used < budget:
        value, rank = heapq.heappop(frontier)
        value = -value
        total += value
        used += 1
        # its first child, and its next sibling
        heapq.heappush(frontier, (-value * rank_rates[0], 0))
        if rank + 1 < max_width:
            parent = value / rank_rates[rank]
            heapq.heappush(frontier, (-parent * rank_rates[rank + 1], rank + 1))
    return total


def chain_length(rate: float, budget: int) -> float:
    return 1.0 + sum(rate ** depth for depth in range(1, budget + 1))


def measure_pair(target, draft, prompts: list[list[int]], new_tokens: int, seed: int, label: str) -> dict[str, list[float]]:
    """Average cumulative sibling rates per rule over the positions of target-sampled continuations."""
    from inference.engine import GenerationConfig, generate_plain
    from inference.engine.lm.modeling import align_vocab

    collected: dict[str, list[list[float]]] = {"rrs": [], "bound": [], "topk": []}
    model = target.model
    width = model.config.vocab_size
    for index, prompt in enumerate(prompts):
        sampled = generate_plain(target, prompt, GenerationConfig(
            max_new_tokens=new_tokens, temperature=1.0, seed=seed * 1000 + index, eos_token_id=()))
        # [1, prompt + new]
        ids = torch.tensor([prompt + sampled.token_ids])
        with torch.inference_mode():
            # [new, vocab]: what each model gives at the positions the sample visited
            p_all = model(ids).logits[0, len(prompt) - 1:-1].float().softmax(-1)
            q_logits = draft(ids.clamp(max=draft.config.vocab_size - 1)).logits[0, len(prompt) - 1:-1].float()
            q_all = align_vocab(q_logits, width).softmax(-1)
        for p, q in zip(p_all, q_all):
            for rule, values in position_rates(p, q).items():
                collected[rule].append(values)
        print(f"  {label}: prompt {index + 1}/{len(prompts)}", flush=True)
    return {rule: [statistics.mean(values[k] for values in rows) for k in range(len(rows[0]))]
            for rule, rows in collected.items()}


def report(label: str, cumulative: dict[str, list[float]], budget: int) -> dict[str, float]:
    chain = cumulative["rrs"][0]
    base = chain_length(chain, budget)
    print(f"{label}: per-position acceptance, first sibling {chain:.3f}")
    ratios = {}
    for rule in ("rrs", "bound", "topk"):
        values = cumulative[rule]
        per_rank = [values[0]] + [values[k] - values[k - 1] for k in range(1, len(values))]
        per_rank = [max(rate, 1e-9) for rate in per_rank]
        tree = best_tree(per_rank, budget, len(per_rank))
        # a topk first sibling is not the sampled chain's: compare with the chain of its own rule
        ratios[rule] = tree / base
        print(f"  {rule:<6} sibling gains {', '.join(f'{rate:.3f}' for rate in per_rank)}; best {budget}-node "
              f"tree {tree:.2f} tokens/step vs chain {base:.2f}: {tree / base:.2f}x")
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=os.environ.get("SPECOPS_MODEL_DIR", str(ROOT / "models")))
    parser.add_argument("--weak-steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from bench.weak_draft import build_weak_draft
    from inference.demo.prompts import load_heldout_prompts
    from inference.engine.lm.loading import load_causal_lm

    model_dir = Path(args.model_dir)
    require_demo_pair(model_dir)
    target = load_causal_lm(model_dir / "demo-target")
    drafts = {"demo": load_causal_lm(model_dir / "demo-draft").model,
              "weak": load_causal_lm(build_weak_draft(model_dir, args.weak_steps)).model}
    tokenizer = target.tokenizer
    texts = load_heldout_prompts(model_dir / "heldout_prompts.json")[: args.prompts]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"][: args.prompt_tokens] for text in texts]
    ratios = {}
    for label, draft in drafts.items():
        cumulative = measure_pair(target, draft, prompts, args.new_tokens, args.seed, label)
        ratios[label] = report(f"{label} pair, temperature 1.0, budget {args.budget}", cumulative, args.budget)
    print(f"RESULT tree_over_chain_rrs_weak_t1={ratios['weak']['rrs']:.2f} "
          f"tree_over_chain_bound_weak_t1={ratios['weak']['bound']:.2f} "
          f"tree_over_chain_topk_weak_t1={ratios['weak']['topk']:.2f} "
          f"tree_over_chain_rrs_demo_t1={ratios['demo']['rrs']:.2f} "
          f"tree_over_chain_bound_demo_t1={ratios['demo']['bound']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
