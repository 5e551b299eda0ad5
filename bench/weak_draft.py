"""A weaker draft for the demo target, built and cached by the engine benchmark.

Trees pay where acceptance per position is middling; the demo draft is too close to its
target (per-token alpha ~0.85) to show it. This draft has the demo draft's shape and start
(the target's embeddings, head and first layer) but is distilled for a few steps only, on the
training split of the standard library (never the held-out files the prompts come from).
The demo draft's shape (from its config.json), from scratch.
Deterministic: fixed seed and step count, nothing downloaded. Cached under
MODEL_DIR/weak-draft-s<steps>/ with a marker naming the recipe and the target it was distilled
from, so a rebuilt target rebuilds it.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from inference.demo import corpus
from inference.demo.builder import DemoBuildConfig, copy_matching_weights
from inference.demo.model_files import is_complete, random_causal_lm, save_model_dir
from inference.demo.training import OptimConfig, distil_draft, encode_stream
from inference.engine.lm.loading import load_causal_lm

RECIPE = 1
CORPUS_CHARS = 1_500_000


def _target_digest(target_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(target_dir.glob("*.safetensors")) + [target_dir / "config.json"]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def weak_draft_dir(model_dir: Path, steps: int) -> Path:
    return Path(model_dir) / f"weak-draft-s{steps}"


def build_weak_draft(model_dir: Path, steps: int, seed: int = 0, threads: int = 1,
                     corpus_chars: int = CORPUS_CHARS) -> Path:
    """Return the directory of the weak draft, distilling it first unless it is cached."""
    model_dir = Path(model_dir)
    target_dir = model_dir / "demo-target"
    directory = weak_draft_dir(model_dir, steps)
    marker = {"recipe": f"weak-draft-{RECIPE}", "steps": steps, "seed": seed,
              "corpus_chars": corpus_chars, "target": _target_digest(target_dir)}
    if is_complete(directory, marker):
        return directory
    started = time.monotonic()
    print(f"building weak draft ({steps} distillation steps) into {directory}", flush=True)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        target = load_causal_lm(target_dir)
        config = DemoBuildConfig()
        train, _ = corpus.split_heldout(corpus.stdlib_source_files(), config.heldout_fraction)
        texts = list(corpus.iter_texts(corpus.spread_files(train, corpus_chars), corpus_chars))
        stream = encode_stream(target.tokenizer, texts)
        # the demo draft's own shape and family, weights from scratch (then the target's start)
        draft = random_causal_lm(AutoConfig.from_pretrained(model_dir / "demo-draft"), seed)
        copy_matching_weights(target.model, draft)
        optim = OptimConfig(steps=steps, batch_size=8, seq_len=128, lr=2e-3,
                            warmup_steps=min(5, steps), checkpoint_every=max(steps, 1))
        checkpoint = model_dir / f".weak-draft-s{steps}.ckpt"
        distil_draft(draft, target.model.float(), stream,
                     torch.empty(0, 0, dtype=torch.int32), optim, seed, checkpoint,
                     greedy_fraction=0.0)
        save_model_dir(draft.eval(), target.tokenizer, directory, marker)
        checkpoint.unlink(missing_ok=True)
    finally:
        torch.set_num_threads(previous_threads)
    print(f"weak draft built in {time.monotonic() - started:.0f} s", flush=True)
    return directory
