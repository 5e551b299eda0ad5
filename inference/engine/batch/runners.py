"""The engine's model runners: which of its models run compiled on static pools, and their caches.

`CompileSettings.mode` is the platform's `SPECOPS_ENGINE_COMPILE`: "auto" runs every model the
static forward supports (runner/static_forward.py) on preallocated pools through a
`ModelRunner` — compiled where its package is built, the same function eagerly until then —
and leaves the rest on the growing caches of kv/ragged.py, with a log line saying why; "off"
runs every model as before. The pools are sized for the batch's rows (rounded up to a bucket),
the model's context plus the widest forward, within `kv_budget_mb`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel

from inference.engine.drafters.dspark.compiled import BlockRunner
from inference.engine.drafters.dspark.modeling import DSparkModel
from inference.engine.errors import ConfigError
from inference.engine.kv.ragged import RaggedCache
from inference.engine.kv.static_ragged import StaticRaggedCache
from inference.engine.lm.modeling import context_length, logits_width
from inference.engine.runner.buckets import ShapeBuckets
from inference.engine.runner.builder import BUILD_NICENESS
from inference.engine.runner.kv_pool import PoolShape, pool_rows_within
from inference.engine.runner.model_runner import COMPILE_AUTO, COMPILE_MODES, COMPILE_OFF, ModelRunner, RunnerStats
from inference.engine.runner.static_forward import static_forward_refusal

logger = logging.getLogger(__name__)

# The widest verify a compiled forward takes (the pending token and a draft tree of up to 63
# nodes); a wider one (or a longer prefill chunk) runs eagerly.
MAX_VERIFY_WIDTH = 64


@dataclass(frozen=True)
class CompileSettings:
    """How the engine runs its models (see the module docstring). store: where compiled packages
    live (None: eager static forwards only, nothing compiled); background: build missing packages
    in builder processes (else only `ModelRunner.compile_now` builds), at `build_niceness`."""

    mode: str = COMPILE_OFF
    store: Path | None = None
    kv_budget_mb: int = 4096
    background: bool = True
    build_niceness: int = BUILD_NICENESS

    def __post_init__(self) -> None:
        if self.mode not in COMPILE_MODES:
            raise ConfigError(f"compile mode: must be one of {', '.join(COMPILE_MODES)}, got {self.mode!r}")


class ModelRunners:
    """The target's and the draft's runners (None: that model runs on kv/ragged.py), and the
    DSpark checkpoint's compiled block (None: no checkpoint, or nothing compiled)."""

    def __init__(self, target: ModelRunner | None, draft: ModelRunner | None,
                 refusals: dict[str, str], dspark: BlockRunner | None = None) -> None:
        self.target = target
        self.draft = draft
        self.dspark = dspark
        self.refusals = refusals  # "target"/"draft" -> why it runs eagerly

    @classmethod
    def build(cls, settings: CompileSettings, target: PreTrainedModel, draft: PreTrainedModel | None,
              model_dirs: tuple[Path | None, Path | None], max_rows: int, max_tokens: int,
              taps: tuple[int, ...] = (), dspark: DSparkModel | None = None) -> ModelRunners:
        if settings.mode == COMPILE_OFF:
            return cls(None, None, {})
        runners: dict[str, ModelRunner | None] = {"target": None, "draft": None}
        refusals: dict[str, str] = {}
        for role, model, model_dir, model_taps in (("target", target, model_dirs[0], taps),
                                                   ("draft", draft, model_dirs[1], ())):
            if model is None:
                continue
            refusal = static_forward_refusal(model)
            if refusal is not None:
                refusals[role] = refusal
                logger.info("the %s runs eagerly (not compiled): %s", role, refusal)
                continue
            capacity = context_length(model) + max_tokens
            rows = ShapeBuckets.for_device(max_rows, max_tokens, model.device.type).max_rows
            # two rows at least: a compiled forward's rows are a symbol, which needs a range
            rows = pool_rows_within(PoolShape.of(model), capacity, settings.kv_budget_mb * 2**20, max(rows, 2))
            runner = ModelRunner(model, rows, capacity, max_tokens, COMPILE_AUTO, settings.store, model_taps,
                                 model_dir if settings.background else None, settings.build_niceness)
            runner.start()
            runners[role] = runner
        block = None
        if dspark is not None and settings.store is not None:
            block = BlockRunner(dspark, logits_width(target), context_length(target), settings.store,
                                settings.background, settings.build_niceness)
            block.start()
        return cls(runners["target"], runners["draft"], refusals, block)

    def runner_of(self, model: PreTrainedModel) -> ModelRunner | None:
        for runner in (self.target, self.draft):
            if runner is not None and runner.model is model:
                return runner
        return None

    def new_cache(self, model: PreTrainedModel, packed: bool = False) -> RaggedCache | StaticRaggedCache:
        """A batch cache for `model`: on its runner's pool, or a growing one."""
        runner = self.runner_of(model)
        if runner is None:
            return RaggedCache(model, packed=packed)
        return StaticRaggedCache(runner)

    def loads(self) -> int:
        """Packages loaded by every runner so far (the engine re-profiles its costs when it grows)."""
        return sum(runner.loads for runner in self.all())

    def poll(self) -> None:
        for runner in self.all():
            runner.poll()

    def snapshot(self) -> dict[str, RunnerStats]:
        """Each runner's stats (copies), by role: what a step report carries to the worker's metrics."""
        return {role: runner.stats.copy() for role, runner in (("target", self.target), ("draft", self.draft),
                                                                ("dspark", self.dspark))
                if runner is not None}

    def all(self) -> list[ModelRunner | BlockRunner]:
        return [runner for runner in (self.target, self.draft, self.dspark) if runner is not None]

    def close(self) -> None:
        for runner in self.all():
            runner.close()
