"""DSpark's greedy block as one compiled program: backbone, lm head, Markov chain, confidence head.

A DSpark step in eager PyTorch dispatches a few hundred small operators: the backbone over the
rows' contexts, the lm head, then one position at a time the Markov head's bias, the argmax and
its log-probability, and the confidence head. `GreedyBlock` is all of it as one pure function of
tensors — each row's context keys and values (zero-padded to the longest, a row's own length
hiding the padding), its anchor and the anchor's position in, every position's greedy token, its
log-probability and its confidence logit out — exported once per checkpoint architecture and
compiled by AOTInductor (runner/artifacts.py), with the rows and the context slots as symbols.

`BlockRunner` finds the package (`SPECOPS_COMPILE_DIR`), or has a builder process make it
(``python -m inference.engine.drafters.dspark.compiled``, the arguments of runner/builder.py)
while the eager drafter serves; until then, and for sampled rows (their draws use the rows'
generators, drafter.py), blocks are drafted eagerly as before. The compiled block draws the tokens
the eager one draws up to rounding in the last bits of a logit: greedy output never depends on
the draft (verification keeps the target's argmax).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from inference.engine.drafters.dspark.modeling import DSparkModel
from inference.engine.lm.modeling import align_vocab
from inference.engine.runner.artifacts import (
    MAX_ROWS,
    CompiledForward,
    device_tag,
    export_and_package,
    sources_digest,
)
from inference.engine.runner.builder import BUILD_NICENESS, BackgroundBuild, background_build, run_build
from inference.engine.runner.model_runner import PATH_COMPILED, PATH_EAGER, RunnerStats

logger = logging.getLogger(__name__)

PROGRAM = "inference.engine.drafters.dspark.compiled"
KIND = "dspark_block"
_HERE = Path(__file__).resolve().parent
_SOURCES = (_HERE / "compiled.py", _HERE / "modeling.py", _HERE.parents[1] / "runner" / "artifacts.py")


@dataclass(frozen=True)
class BlockSpec:
    """A package's bounds: the most context slots a row has, and the target's vocabulary width."""

    capacity: int
    vocab_width: int


class GreedyBlock(nn.Module):
    """rows' anchors [R], their positions [R], context lengths [R] and per backbone layer the
    context keys and values [R, kv_heads, slots, head_dim] -> tokens [R, γ] int64, their
    log-probabilities [R, γ] float32 and the confidence head's logits [R, γ] float32 (zeros
    without a confidence head)."""

    def __init__(self, model: DSparkModel, vocab_width: int) -> None:
        super().__init__()
        self.model = model
        self.vocab_width = vocab_width

    def forward(self, anchors: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                *context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model, block = self.model, self.model.block_size
        keys, values = list(context[0::2]), list(context[1::2])
        dtype = keys[0].dtype
        rows, slots = anchors.shape[0], keys[0].shape[2]
        # [rows, 1, block, slots + block]: a row's padded context slots are hidden, its block seen whole
        hidden_slots = torch.arange(slots, device=anchors.device)[None] >= lengths[:, None]
        cached = torch.zeros(rows, slots, dtype=dtype, device=anchors.device).masked_fill(
            hidden_slots, torch.finfo(dtype).min)
        mask = torch.cat((cached[:, None, None, :].expand(rows, 1, block, slots),
                          torch.zeros(rows, 1, block, block, dtype=dtype, device=anchors.device)), dim=-1)
        hidden = model.block_hidden(model.block_ids(anchors), starts, keys, values, mask)
        base = model.lm_head(hidden)
        previous, tokens, log_probs, previous_ids = anchors, [], [], []
        for position in range(block):
            previous_ids.append(previous)
            logits = align_vocab(model.markov_logits(base[:, position], previous, hidden[:, position]),
                                 self.vocab_width)
            best, token = logits.float().log_softmax(dim=-1).max(dim=-1)
            tokens.append(token)
            log_probs.append(best)
            previous = token
        confidence = model.confidence_logits(hidden, torch.stack(previous_ids, dim=1))
        if confidence is None:
            confidence = torch.zeros(rows, block, device=anchors.device)
        return torch.stack(tokens, dim=1), torch.stack(log_probs, dim=1), confidence


def architecture_digest(model: DSparkModel) -> str:
    """The checkpoint's config and dtype: what a package's code depends on (weights load at run time)."""
    config = model.dspark
    backbone = config.backbone.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures"):
        backbone.pop(volatile, None)
    fields = {name: value for name, value in asdict(config).items() if name != "backbone"}
    text = json.dumps({"backbone": backbone, **fields}, sort_keys=True, default=str) + str(model.fc.weight.dtype)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def package_name(model: DSparkModel, spec: BlockSpec) -> str:
    key = json.dumps({"arch": architecture_digest(model), "spec": asdict(spec), "torch": torch.__version__,
                      "device": device_tag(model.fc.weight.device), "source": sources_digest(_SOURCES)},
                     sort_keys=True)
    return f"dspark-{KIND}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt2"


def example_inputs(model: DSparkModel) -> tuple[torch.Tensor, ...]:
    """2 rows over 5 context slots (one row shorter than the other)."""
    device, dtype = model.fc.weight.device, model.fc.weight.dtype
    attention = model.layers[0].self_attn
    rows, slots = 2, 5
    inputs = [torch.ones(rows, dtype=torch.long, device=device), torch.tensor([5, 3], device=device),
              torch.tensor([5, 3], device=device)]
    for _ in model.layers:
        inputs += [torch.zeros(rows, attention.kv_heads, slots, attention.head_dim, dtype=dtype, device=device)
                   for _ in range(2)]
    return tuple(inputs)


def dynamic_shapes(model: DSparkModel, spec: BlockSpec) -> tuple:
    rows = torch.export.Dim("rows", min=1, max=MAX_ROWS)
    slots = torch.export.Dim("slots", min=1, max=spec.capacity)
    # the context tensors are the forward's *args: one element of the structure export compares
    return ({0: rows}, {0: rows}, {0: rows}, tuple({0: rows, 2: slots} for _ in range(2 * len(model.layers))))


def build_block_package(model: DSparkModel, spec: BlockSpec, path: Path) -> float:
    """Export and compile `GreedyBlock` into `path`; the seconds it took (raises what export raises)."""
    block = GreedyBlock(model, spec.vocab_width).eval()
    return export_and_package(block, example_inputs(model), dynamic_shapes(model, spec), path)


class BlockRunner:
    """Greedy DSpark blocks of one checkpoint, compiled once its package is loaded.

    capacity: the most context positions a row has (the target's context length). store: where
    packages live (None: never compiled). The checkpoint's directory (`DSparkModel.directory`)
    is what a builder process loads; without one, only `compile_now` builds.
    """

    def __init__(self, model: DSparkModel, vocab_width: int, capacity: int, store: Path | None,
                 background: bool = True, build_niceness: int = BUILD_NICENESS) -> None:
        self.model = model
        self.spec = BlockSpec(capacity, vocab_width)
        self.store = store
        self.background = background
        self.build_niceness = build_niceness
        self.stats = RunnerStats(main_kind=KIND)
        self.loads = 0
        self._compiled: CompiledForward | None = None
        self._build: BackgroundBuild | None = None
        self._next_poll = 0.0
        if store is None:
            self.stats.fallback = "no package store"

    @property
    def ready(self) -> bool:
        return self._compiled is not None

    def package_path(self) -> Path:
        return self.store / package_name(self.model, self.spec)

    def start(self) -> None:
        """Load the package if it is built; else start its builder process (a model with a directory)."""
        if self.store is None or self.stats.fallback or self.ready or self._build is not None:
            return
        path = self.package_path()
        directory = getattr(self.model, "directory", None)
        if path.exists():
            self._load(path, hit=True)
        elif self.background and directory is not None:
            self.stats.cache_misses += 1
            self._build = background_build(Path(directory), self.model.fc.weight.dtype, self.spec, path,
                                           self.store / "logs", self.build_niceness, PROGRAM)
            self.stats.building = (KIND,)
            logger.info("compiling the DSpark block in the background (%s)", path.name)

    def compile_now(self) -> None:
        """Build (here, now) and load the package: tests and benchmarks."""
        path = self.package_path()
        if not path.exists():
            self.stats.cache_misses += 1
            self.stats.compile_seconds += build_block_package(self.model, self.spec, path)
            self._load(path, hit=False)
        elif not self.ready:
            self._load(path, hit=True)

    def poll(self) -> None:
        """Load the package when its builder process has finished (looks at most once a second)."""
        if self._build is None or time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + 1.0
        build = self._build
        if not build.done():
            return
        self._build, self.stats.building = None, ()
        self.stats.compile_seconds += time.monotonic() - build.started
        if build.succeeded:
            self._load(build.out, hit=False)
        else:
            self._give_up(f"compiling the DSpark block failed: {build.failure()}")

    def _load(self, path: Path, hit: bool) -> None:
        try:
            self._compiled = CompiledForward(path, self.model)  # its tensors are "model.*" in GreedyBlock
        except Exception as error:  # a stale or foreign package: draft eagerly, say why
            self._give_up(f"loading {path.name} failed: {type(error).__name__}: {error}")
            return
        self.loads += 1
        self.stats.cache_hits += int(hit)
        self.stats.compiled_kinds = (KIND,)
        logger.info("compiled DSpark block loaded (%s)", path.name)

    def _give_up(self, reason: str) -> None:
        self._compiled = None
        self.stats.fallback, self.stats.compiled_kinds = reason, ()
        logger.warning("the DSpark drafter drafts eagerly: %s", reason)

    def close(self) -> None:
        if self._build is not None:
            self._build.stop()
            self._build = None

    def draft(self, anchors: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
              context: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens, log-probabilities and confidence logits of the rows' greedy blocks (see GreedyBlock)."""
        self.stats.forwards[PATH_COMPILED] += 1
        return tuple(self._compiled([anchors, starts, lengths, *(tensor.contiguous() for tensor in context)]))


def _build(model_dir: Path, dtype: torch.dtype, fields: dict[str, Any], out: Path) -> float:
    from inference.engine.drafters.dspark.checkpoint import load_dspark

    model = load_dspark(model_dir).to(dtype=dtype)
    return build_block_package(model, BlockSpec(**fields), out)


def main(argv: list[str] | None = None) -> int:
    return run_build(argv, PROGRAM, "Build a DSpark checkpoint's compiled greedy block (an AOTInductor package).",
                     _build)


if __name__ == "__main__":
    sys.exit(main())
