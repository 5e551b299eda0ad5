"""What the front and its engine core say to each other (pickled over a local ZMQ socket).

Front -> core: `Submit`, `Cancel`, `DropPairs`, `AddToCorpus`, `Preload`, `Replay`.
Core -> front: `Ready` once its loop runs, one `StepReport` per engine step, `Refused` for a
submit the engine would not take, `ReplayDone`, and `Heartbeat` while idle (so a front can tell a
stuck core from an idle one).

Both ends are this project's own processes, started by the same user on one host, so pickle is
safe here and keeps the engine's dataclasses (BatchRequest, RowEvent) as they are.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from inference.engine.batch.rows import BatchRequest, RowEvent, StepTiming
from inference.engine.config import GenerationConfig
from inference.engine.kv.prefix_cache import PrefixCacheStats

Pair = tuple[int, "int | None"]  # (target version id, draft version id or None)


@dataclass(frozen=True)
class ModelSpec:
    """What the core needs to load a model version: its id, directory and device."""

    pk: int
    directory: str
    device: str = "cpu"
    label: str = ""
    dspark_directory: str | None = None
    dtype: str = ""  # register_model --dtype; empty: the loader's default (float32 on a CPU)

    @classmethod
    def of(cls, version) -> ModelSpec:
        """The spec of a metadata.models.ModelVersion (or anything with its attributes)."""
        dspark = getattr(version, "dspark_directory", None)
        return cls(pk=version.pk, directory=str(version.directory), device=getattr(version, "device", "cpu"),
                   label=str(version), dspark_directory=str(dspark) if dspark else None,
                   dtype=getattr(version, "dtype", "") or "")

    @property
    def path(self) -> Path:
        return Path(self.directory)

    def __str__(self) -> str:
        return self.label or f"version {self.pk}"


@dataclass(frozen=True)
class EngineSettings:
    """How the engines of one device are built (the worker's settings, read in the front)."""

    max_rows: int = 8
    prefill_chunk: int = 0  # 0: the engine's default
    policy_enabled: bool = True
    prefill_mode: str | None = None  # None: the device's default (conf "auto")
    pack_linear: bool = False
    onednn_linear: bool = True
    resident_models: int = 4
    prefix_cache_mb: int = 0  # the device's prefix cache (kv/prefix_cache.py); 0: off
    prefix_cache_block: int = 16
    compile: str = "off"  # "auto": compiled forwards on static pools (engine/runner/); "off": eager
    compile_dir: str = ""  # where compiled packages live ("": nothing compiled, static pools still used)
    kv_cache_mb: int = 4096  # each model's preallocated KV pools (the compiled path)
    compile_background: bool = True  # build missing packages in builder processes


# -- front -> core --------------------------------------------------------------------------

@dataclass(frozen=True)
class Submit:
    pair: Pair
    request: BatchRequest
    target: ModelSpec
    draft: ModelSpec | None
    dspark: bool = False  # run the target's DSpark drafter (target.dspark_directory)


@dataclass(frozen=True)
class Cancel:
    request_id: Hashable


@dataclass(frozen=True)
class DropPairs:
    """Drop these pairs' engines if they are idle, and unload the versions not in ``keep``."""

    pairs: tuple[Pair, ...]
    keep: frozenset[int] = frozenset()


@dataclass(frozen=True)
class AddToCorpus:
    """Feed the suffix drafter's corpus ``key`` (inference/worker/suffix_feed.py)."""

    key: Hashable
    sequence: tuple[int, ...]


@dataclass(frozen=True)
class Preload:
    """Load these versions (and each target's DSpark drafter) before the first request needs them."""

    specs: tuple[ModelSpec, ...]


@dataclass(frozen=True)
class Replay:
    """Generate target-only, greedy (the losslessness canary, inference/worker/canary.py)."""

    ticket: int
    target: ModelSpec
    prompt_ids: tuple[int, ...]
    config: GenerationConfig


# -- core -> front --------------------------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Heartbeat:
    at: float


@dataclass
class StepReport:
    """One engine step: its rows' events and what the front's metrics and traces need of it.

    ``failure`` set: the step raised, the engine is gone, and every row of ``pair`` failed with it.
    """

    pair: Pair
    events: list[RowEvent] = field(default_factory=list)
    forward_log: list[tuple[str, int, int, float]] = field(default_factory=list)
    decision_depth: int | None = None
    running: int = 0  # rows across every engine of the device, after the step
    step_costs: dict | None = None  # the cost tables, every so often (metrics.observe_step_costs)
    timing: StepTiming | None = None
    steps: int = 0
    seconds: float = 0.0  # the step's wall time in the engine (what the front's handling must stay below)
    failure: str = ""
    prefix_cache: PrefixCacheStats | None = None  # the device's prefix cache after the step (a copy)
    early: bool = False  # the step's newcomers' first tokens, sent before its decode forward (no costs)
    runners: dict | None = None  # the engine's model runners' stats by role (engine/runner/), totals so far


@dataclass(frozen=True)
class Refused:
    """The engine would not take a submitted request (its settings): the session ends with this error."""

    request_id: Hashable
    pair: Pair
    error: str


@dataclass(frozen=True)
class ReplayDone:
    ticket: int
    token_ids: Sequence[int] = ()
    error: str = ""
