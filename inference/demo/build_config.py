"""What a demo build depends on: sizes, steps and seeds, hashed to tell a finished build's reuse.

Apart from the builder (`inference.demo.builder`), which runs the phases, so the presets (the
default pair, `quick()` for tests, `starter()` for a first `make run`) read on their own.
`DSparkBuildConfig` is the last phase's: the target's DSpark drafter, trained after the pair.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from inference.demo.model_files import ModelShape
from inference.demo.training import OptimConfig

BUILD_RECIPE_VERSION = 1
DSPARK_RECIPE_VERSION = 1


@dataclass(frozen=True)
class DSparkBuildConfig:
    """The DSpark phase: the demo target's DSpark drafter, trained on the target's own text.

    Its hash (with the pair's) is recorded in the drafter's directory, so the phase reruns only
    when either changes; it is not part of the pair's hash, so adding or retuning it never
    retrains a finished pair. Sized for ~10 minutes on the 2-core CPU: the target writes
    `sequences` continuations of corpus prompts (half greedy, half sampled at T = 1: the
    contexts greedy and sampled requests produce), and `heldout_sequences` greedy ones of
    held-out files for the figures and the calibration; then `budget_s` seconds of training.
    Measured on the default target (20 x 192), 2 threads on the 2-core machine shared with
    other work (load 2-5): the text 0.8-1.2 s a sequence, a step (4 sequences x 64 anchor
    blocks, one target forward per two steps) 0.6-1.6 s; the phase took 708 s (714 steps). At
    lr 5e-3 the held-out τ after 200 steps matched lr 2e-3's after 305.
    """

    budget_s: float = 420.0
    block_size: int = 7
    layers: int = 1
    markov_rank: int = 32
    sequences: int = 224
    heldout_sequences: int = 16
    prompt_tokens: int = 32
    new_tokens: int = 160
    sampled_fraction: float = 0.5
    corpus_chars: int = 400_000
    batch_size: int = 4
    anchors_per_sequence: int = 64
    lr: float = 5e-3
    seed: int = 0

    def digest(self) -> str:
        payload = json.dumps({"recipe": DSPARK_RECIPE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DemoBuildConfig:
    """Everything the demo pair depends on; its hash decides whether a finished build is reused.

    Step counts, not wall time, bound the training, so the same config and seed give the same
    weights (bit for bit on the same machine and thread count).

    Sizes, measured on the 2-core CPU (one cached forward at 200 tokens of context, 2 threads):
    a forward of a small model costs a fixed overhead per layer, not FLOPs, so the target is
    deep and thin (20 x 192, 8.9M parameters, ~5.7 ms; 5 new tokens ~8.8 ms) and the draft is
    one layer of the same width (1.2M parameters, ~0.63 ms; ratio ~0.11), which lets the draft
    start from the target's embeddings and first layer. The defaults built in ~10 minutes with
    greedy acceptance ~0.82 at draft length 4 on the held-out prompts.
    """

    seed: int = 0
    arch: str = "llama"
    vocab_size: int = 4096
    context_length: int = 512
    tokenizer_sample_chars: int = 3_000_000
    max_corpus_chars: int | None = None
    heldout_fraction: float = 0.05
    # Deep and thin target: each layer costs a fixed overhead per forward on a CPU, so depth makes
    # the target's forward costly while width (training cost) stays small. One-layer draft.
    target: ModelShape = ModelShape(layers=20, hidden=192, heads=4, kv_heads=2, intermediate=512,
                                    context_length=512)
    draft: ModelShape = ModelShape(layers=1, hidden=192, heads=4, kv_heads=2, intermediate=512,
                                   context_length=512)
    target_optim: OptimConfig = OptimConfig(steps=500, batch_size=8, seq_len=256, lr=3e-3,
                                            warmup_steps=30)
    greedy_sequences: int = 128
    greedy_prompt_tokens: int = 64
    greedy_new_tokens: int = 192
    draft_optim: OptimConfig = OptimConfig(steps=300, batch_size=8, seq_len=256, lr=2e-3,
                                           warmup_steps=10)
    greedy_fraction: float = 0.5
    draft_from_target: bool = True
    prompt_count: int = 32
    prompt_tokens: int = 96
    eval_new_tokens: int = 64
    # Fields added after the first recipe: hashed only when set, so finished builds stay valid.
    corpus_spread: bool = False  # take max_corpus_chars from files spread over the library
    target_budget_s: float | None = None  # stop training the target after this long (quick pair)
    # The DSpark phase after the pair (None: skipped). Not in `digest()`: it has its own hash.
    dspark: DSparkBuildConfig | None = DSparkBuildConfig()

    @classmethod
    def quick(cls, seed: int = 0) -> DemoBuildConfig:
        """A build of seconds, for tests and smoke runs: the same phases on toy sizes."""
        return cls(
            seed=seed,
            vocab_size=320,
            context_length=128,
            tokenizer_sample_chars=60_000,
            max_corpus_chars=300_000,
            target=ModelShape(layers=2, hidden=48, heads=4, kv_heads=2, intermediate=96,
                              context_length=128),
            draft=ModelShape(layers=1, hidden=48, heads=4, kv_heads=2, intermediate=96,
                             context_length=128),
            target_optim=OptimConfig(steps=12, batch_size=4, seq_len=64, lr=3e-3, warmup_steps=2,
                                     checkpoint_every=5),
            greedy_sequences=8,
            greedy_prompt_tokens=16,
            greedy_new_tokens=32,
            draft_optim=OptimConfig(steps=12, batch_size=4, seq_len=48, lr=3e-3, warmup_steps=2,
                                    checkpoint_every=5),
            prompt_count=4,
            prompt_tokens=24,
            eval_new_tokens=16,
            dspark=None,  # the quick pair serves at once: no DSpark drafter to train
        )

    @classmethod
    def starter(cls, seed: int = 0) -> DemoBuildConfig:
        """The quick pair `make run` serves first: built in well under a minute on a busy machine.

        The target trains for at most 400 steps or 15 s, whichever comes first (the only
        time-bounded phase: on a loaded machine a step count alone could take minutes), on a
        slice of the library spread over many packages. Its text is Python-flavoured noise
        (keywords, `self.`, indentation), not code: the full pair replaces it when trained.

        Its context is 1024 tokens, though it trains on 64: positions are rotary (no weights), and
        a client's first requests must fit. With its 1024-token vocabulary (about 2 characters a
        token) the tool block of a one-function request is ~365 tokens (the instructions 156, the
        function's schema the rest) and an 8-turn chat of short turns ~390 before the reply; 256
        refused every `tools` request.
        """
        return cls(
            seed=seed,
            vocab_size=1024,
            context_length=1024,
            tokenizer_sample_chars=400_000,
            max_corpus_chars=400_000,
            corpus_spread=True,
            target_budget_s=15.0,
            target=ModelShape(layers=2, hidden=96, heads=4, kv_heads=2, intermediate=192,
                              context_length=1024),
            draft=ModelShape(layers=1, hidden=96, heads=4, kv_heads=2, intermediate=192,
                             context_length=1024),
            target_optim=OptimConfig(steps=400, batch_size=8, seq_len=64, lr=1e-2,
                                     warmup_steps=10, checkpoint_every=50),
            greedy_sequences=8,
            greedy_prompt_tokens=16,
            greedy_new_tokens=32,
            draft_optim=OptimConfig(steps=20, batch_size=8, seq_len=48, lr=5e-3, warmup_steps=2,
                                    checkpoint_every=20),
            prompt_count=4,
            prompt_tokens=32,
            eval_new_tokens=16,
            dspark=None,
        )

    def digest(self) -> str:
        """The pair's hash: every field that shapes the target and the draft (not `dspark`)."""
        fields = asdict(self)
        del fields["dspark"]
        for name, default in _LATER_FIELDS.items():
            if fields[name] == default:
                del fields[name]
        payload = json.dumps({"recipe": BUILD_RECIPE_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


#: Fields added after BUILD_RECIPE_VERSION 1, with the value that means "as before".
_LATER_FIELDS = {"corpus_spread": False, "target_budget_s": None}
