#!/usr/bin/env bash
# The compiled engine's GPU check, as one call on a lent GPU machine (the device tool), at most 8 minutes:
#
#     bash bench/gpu_bench.sh            # the device tool's run: command "bash bench/gpu_bench.sh", carry ["models"]
#
# Runs under the machine's own python3 and torch (nothing to install; the project never needs a
# GPU). Uses the demo pair carried in models/ (demo-target, demo-draft, heldout_prompts.json: about
# 50 MiB) or, when none was carried, builds it there first (about 100 s on an H200, bench/README).
# Then bench/serving.py with --device cuda, the batched engine eager against compiled (AOTInductor
# packages built there into var/compiled, replayed as CUDA graphs per bucket), concurrency 1 and 8,
# no API part. Everything it prints, and its RESULT line, goes to $OUT/gpu_bench.log as well.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
out=${OUT:-var}
mkdir -p "$out"
log=$out/gpu_bench.log
started=$SECONDS
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
  if [[ ! -f models/demo-target/config.json ]]; then
    echo "no demo pair carried: building it on the GPU"
    timeout 200 python3 -m inference.demo.builder --out models --device cuda --no-progress --dspark-budget-s 30 || echo "demo build: failed or cut short"
  fi
  timeout $((470 - (SECONDS - started))) python3 bench/serving.py --device cuda --skip-api --repeats 1 \
    --concurrency 1,8 --requests 16 --sequential-max 1 --drafters draft_model,ngram --compile-dir var/compiled
  echo "exit $? after $((SECONDS - started)) s"
} 2>&1 | tee "$log"
