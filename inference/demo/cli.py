"""The demo build's command line: ``python -m inference.demo.builder`` (or ``-m inference.demo.cli``).

One-line errors and a non-zero exit on failure; the build itself is builder.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

from inference.demo import corpus
from inference.demo.build_config import DemoBuildConfig
from inference.demo.builder import DemoBuildError, build_demo_models


def main(argv: list[str] | None = None) -> int:
    """Command line: build the demo pair into --out; one-line errors, non-zero exit on failure."""
    parser = argparse.ArgumentParser(prog="python -m inference.demo.builder",
                                     description="Build the demo target/draft pair.")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="toy sizes, seconds (smoke test)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--device", default="cpu", help="where to train: cpu (default) or cuda")
    parser.add_argument("--dspark-budget-s", type=float,
                        help="the DSpark phase's training budget (default: the recipe's; another value is "
                             "another DSpark build, with its own hash)")
    parser.add_argument("--dspark-sequences", type=int,
                        help="target-written sequences the DSpark drafter trains on (default: the recipe's)")
    args = parser.parse_args(argv)
    config = DemoBuildConfig.quick(args.seed) if args.quick else DemoBuildConfig(seed=args.seed)
    try:
        config = _with_dspark_overrides(config, args.dspark_budget_s, args.dspark_sequences)
        if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
            raise ValueError(f"--device must be cpu or cuda, not {args.device!r}")
        if args.device != "cpu" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device here")
        models = build_demo_models(args.out, config=config, progress=not args.no_progress, device=args.device)
    except KeyboardInterrupt:
        print("error: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except (DemoBuildError, corpus.CorpusError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    summary = {key: models.metrics.get(key) for key in
               ("acceptance", "token_match", "draft_target_cost_ratio", "build_seconds")}
    print(f"target={models.target_dir} draft={models.draft_dir} "
          f"prompts={models.heldout_prompts_path} dspark={models.dspark_dir} {json.dumps(summary)}")
    return 0


def _with_dspark_overrides(config: DemoBuildConfig, budget_s: float | None,
                           sequences: int | None) -> DemoBuildConfig:
    """The config with the DSpark phase's budget or text size changed (ValueError naming the flag)."""
    if budget_s is None and sequences is None:
        return config
    if config.dspark is None:
        raise ValueError("--dspark-budget-s/--dspark-sequences: this configuration has no DSpark phase")
    changes: dict[str, Any] = {}
    if budget_s is not None:
        if not budget_s > 0:
            raise ValueError(f"--dspark-budget-s must be above 0, not {budget_s}")
        changes["budget_s"] = budget_s
    if sequences is not None:
        if sequences < 2:
            raise ValueError(f"--dspark-sequences must be at least 2, not {sequences}")
        changes["sequences"] = sequences
    return dataclasses.replace(config, dspark=dataclasses.replace(config.dspark, **changes))


if __name__ == "__main__":
    sys.exit(main())
