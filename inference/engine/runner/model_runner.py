"""Runs one model's forwards on a static KV pool: compiled where a package is ready, eager where not.

The engine's caches (kv/static_ragged.py) hand the runner a `ForwardBatch` — ids, positions and
boolean masks, every shape known — and the runner turns the masks into the additive tensors the
forward takes, pads the shapes to a bucket where the device replays captured graphs
(buckets.py), runs the compiled package of the batch's kind (artifacts.py) or, until it is built,
the same `StaticForward` eagerly, and writes the new keys and values into the pool.

Compiling is paid once and never blocks serving: a missing package is built by a process of its
own (builder.py) while the eager forward serves, and picked up between two forwards when it
lands; a restarted worker finds it on disk and loads it in milliseconds. A package that fails to
build (an op the compiler cannot lower, a graph break) leaves the runner eager for good, with a
log line and `stats.fallback`. Which path served each forward is counted in `stats`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from inference.engine.runner.artifacts import CompiledForward, GraphSpec, artifact_name, build_package
from inference.engine.runner.buckets import ShapeBuckets
from inference.engine.runner.cuda_graphs import CudaGraphForwards
from inference.engine.runner.builder import BUILD_NICENESS, BackgroundBuild, background_build
from inference.engine.runner.kv_pool import KVPool, PoolShape
from inference.engine.runner.static_forward import LOGITS_ALL, LOGITS_LAST, StaticForward

logger = logging.getLogger(__name__)

COMPILE_AUTO = "auto"  # compile what compiles, serve eagerly meanwhile and where it does not
COMPILE_OFF = "off"  # the eager engine of kv/ragged.py (the runner is not used)
COMPILE_MODES = (COMPILE_AUTO, COMPILE_OFF)

PATH_COMPILED = "compiled"
PATH_EAGER = "eager"

_POLL_SECONDS = 1.0  # how often a forward looks for a finished background build


@dataclass
class ForwardBatch:
    """One forward of R rows x T new tokens over W cached slots (kv/static_ragged.py builds it)."""

    input_ids: torch.Tensor  # [R, T] int64
    position_ids: torch.Tensor  # [R, T] int64
    cached: torch.Tensor  # [R, T, W] bool: which cached slots each new token sees
    among: torch.Tensor  # [R, T, T] bool: which new tokens each new token sees
    width: int  # W
    new: int  # T
    window: tuple[torch.Tensor, torch.Tensor] | None  # [R, T, W] and [R, T, T] bool, a sliding window
    last_index: torch.Tensor | None  # [R] int64, the position whose logits a "last" forward returns
    logits: str  # "all", "last" or "none"

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R', T' or 1, vocab], padded rows and tokens included
    path: str


@dataclass
class RunnerStats:
    """What the runner did, for metrics and the admin (a plain object; the worker exports it)."""

    forwards: dict[str, int] = field(default_factory=lambda: {PATH_COMPILED: 0, PATH_EAGER: 0})
    compile_seconds: float = 0.0  # building packages (here or in builder processes)
    cache_hits: int = 0  # packages found built when first wanted
    cache_misses: int = 0  # packages that had to be built
    fallback: str = ""  # why this model serves eagerly for good ("" while it may compile)
    compiled_kinds: tuple[str, ...] = ()  # the forwards whose packages are loaded
    building: tuple[str, ...] = ()  # the forwards whose packages builder processes are making
    main_kind: str = LOGITS_ALL  # the package whose load makes the runner "compiled" (decode and verify)

    @property
    def compiled(self) -> bool:
        return self.main_kind in self.compiled_kinds

    def copy(self) -> RunnerStats:
        return RunnerStats(dict(self.forwards), self.compile_seconds, self.cache_hits, self.cache_misses,
                           self.fallback, self.compiled_kinds, self.building, self.main_kind)


class ModelRunner:
    """Forwards of one model over static pools; see the module docstring.

    pool_rows, capacity: every pool this runner makes ([pool_rows, layers, kv_heads, capacity,
    head_dim]); max_tokens: the most new tokens per row in one forward. taps: the layers whose
    hidden states a feature-reading drafter needs (features.py ids), returned by `last_features`.
    store: where packages live (None: never compiled). model_dir: the model's directory, which a
    builder process loads (None: packages are built only by `compile_now`, in this process), at
    `build_niceness` (serving keeps the CPU it needs).
    """

    def __init__(self, model: PreTrainedModel, pool_rows: int, capacity: int, max_tokens: int,
                 compile_mode: str = COMPILE_AUTO, store: Path | None = None, taps: tuple[int, ...] = (),
                 model_dir: Path | None = None, build_niceness: int = BUILD_NICENESS) -> None:
        self.model = model
        # read once: a model's `device` and `dtype` walk its parameters on every access
        self.device, self.dtype = model.device, model.dtype
        self._minimum = torch.finfo(self.dtype).min
        self.shape = PoolShape.of(model)
        self.pool_rows, self.capacity, self.max_tokens = pool_rows, capacity, max_tokens
        self.buckets = ShapeBuckets.for_device(pool_rows, max_tokens, model.device.type)
        self.taps = tuple(taps)
        self.store = store if compile_mode == COMPILE_AUTO else None
        self.model_dir = model_dir
        self.build_niceness = build_niceness
        self._eager = {kind: StaticForward(model, kind, self.taps).eval() for kind in (LOGITS_ALL, LOGITS_LAST)}
        self._compiled: dict[str, CompiledForward] = {}
        self._graphs: dict[str, CudaGraphForwards] = {}  # on a GPU: the packages' graphs by bucket
        self._builds: dict[str, BackgroundBuild] = {}
        self._next_poll = 0.0
        self._strides: tuple[int, ...] | None = None  # the pools' (the compiled code assumes them)
        self.stats = RunnerStats()
        self.last_features: torch.Tensor | None = None
        self.last_path: str | None = None
        self.loads = 0  # packages loaded so far: a change tells the engine its costs changed
        if self.store is None and compile_mode == COMPILE_AUTO:
            self.stats.fallback = "no package store"

    # -- pools and specs -----------------------------------------------------------------------

    def new_pool(self) -> KVPool:
        pool = KVPool(self.shape, self.pool_rows, self.capacity, self.device)
        self._strides = tuple(pool.keys.stride())
        return pool

    def spec(self, kind: str) -> GraphSpec:
        return GraphSpec(kind, self.taps, self.capacity, self.max_tokens)

    def package_path(self, kind: str) -> Path:
        return self.store / artifact_name(self.model, self.spec(kind))

    # -- compiling -----------------------------------------------------------------------------

    def start(self) -> None:
        """Load what is built; start builder processes for what is not (a model with a directory)."""
        if self.store is None or self.stats.fallback:
            return
        for kind in (LOGITS_ALL, LOGITS_LAST):
            if self.stats.fallback:
                return
            if kind in self._compiled or kind in self._builds:
                continue
            path = self.package_path(kind)
            if path.exists():
                self._load(kind, path, hit=True)
            elif self.model_dir is not None:
                self.stats.cache_misses += 1
                self._builds[kind] = background_build(self.model_dir, self.dtype, self.spec(kind), path,
                                                      self.store / "logs", self.build_niceness)
                logger.info("compiling %s's %s forward in the background (%s)", self.model.config.model_type,
                            kind, path.name)
        self.stats.building = tuple(sorted(self._builds))

    def compile_now(self, kinds: tuple[str, ...] = (LOGITS_ALL, LOGITS_LAST)) -> None:
        """Build (here, now) and load the packages of `kinds` that are missing: tests, benchmarks."""
        if self.store is None:
            raise RuntimeError("this runner has no package store")
        for kind in kinds:
            path = self.package_path(kind)
            if not path.exists():
                self.stats.cache_misses += 1
                self.stats.compile_seconds += build_package(self.model, self.spec(kind), path)
                self._load(kind, path, hit=False)
            elif kind not in self._compiled:
                self._load(kind, path, hit=True)

    def _load(self, kind: str, path: Path, hit: bool) -> None:
        try:
            self._compiled[kind] = CompiledForward(path, self.model)
            if self.device.type == "cuda":
                self._graphs[kind] = CudaGraphForwards(self._compiled[kind])
        except Exception as error:  # a stale or foreign package: serve eagerly, say why
            self._give_up(f"loading {path.name} failed: {type(error).__name__}: {error}")
            return
        self.loads += 1
        self.stats.compiled_kinds = tuple(sorted(self._compiled))
        if hit:
            self.stats.cache_hits += 1
        logger.info("compiled %s forward of %s loaded (%s)", kind, self.model.config.model_type, path.name)

    def _give_up(self, reason: str) -> None:
        self.stats.fallback = reason
        self._compiled.clear()
        self._graphs.clear()
        self.stats.compiled_kinds = ()
        logger.warning("%s serves eagerly: %s", self.model.config.model_type, reason)

    def poll(self) -> None:
        """Load the packages whose background builds have finished (cheap: at most once a second)."""
        if not self._builds or time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + _POLL_SECONDS
        for kind, build in list(self._builds.items()):
            if not build.done():
                continue
            del self._builds[kind]
            self.stats.building = tuple(sorted(self._builds))
            self.stats.compile_seconds += time.monotonic() - build.started
            if build.succeeded:
                self._load(kind, build.out, hit=False)
            else:
                self._give_up(f"compiling the {kind} forward failed: {build.failure()}")

    def ready(self, kind: str = LOGITS_ALL) -> bool:
        return kind in self._compiled

    def close(self) -> None:
        for build in self._builds.values():
            build.stop()
        self._builds.clear()

    # -- forwards ------------------------------------------------------------------------------

    def forward(self, pool: KVPool, batch: ForwardBatch) -> ForwardOutput:
        """Run `batch`, write its new keys and values into `pool` at slots width..width+new; its logits."""
        self.poll()
        kind = LOGITS_LAST if batch.logits in ("last", "none") else LOGITS_ALL
        rows, new = batch.rows, batch.new
        compiled = self._compiled.get(kind)
        if compiled is not None and (self._strides != tuple(pool.keys.stride()) or new > self.max_tokens):
            # a pool of another geometry than the package was built for, or a forward wider than
            # its bounds (an unusually large draft tree): this forward runs eagerly
            compiled = None
        graphs = self._graphs.get(kind) if compiled is not None else None
        # a symbol's least value is 1 (an empty cache reads one hole); a replayed graph reads the
        # pool's widest view, always the same address
        width = self.capacity - 1 if graphs is not None else max(batch.width, 1)
        padded_rows, padded_new = self.buckets.fit(rows, new) if compiled is not None else (rows, new)
        inputs = self._inputs(pool, batch, kind, padded_rows, padded_new, width)
        if compiled is not None:
            tensors = [tensor for tensor in inputs if tensor is not None]
            outputs = graphs.run(tensors) if graphs is not None else compiled(tensors)
            self.last_path = PATH_COMPILED
        else:
            with torch.inference_mode():
                outputs = self._eager[kind](*inputs)
            self.last_path = PATH_EAGER
        self.stats.forwards[self.last_path] += 1
        logits, new_keys, new_values = outputs[0], outputs[1], outputs[2]
        pool.write(rows, batch.width, new_keys, new_values, new)
        self.last_features = outputs[3][:rows, :new] if self.taps else None
        return ForwardOutput(logits, self.last_path)

    def _inputs(self, pool: KVPool, batch: ForwardBatch, kind: str, rows: int, new: int,
                width: int) -> list[torch.Tensor | None]:
        """The forward's tensors, padded to `rows` x `new` (padding rows see only themselves)."""
        device, dtype = self.device, self.dtype
        cached, among = batch.cached, batch.among
        if width > batch.width:  # the empty cache's one slot, a hole
            cached = torch.cat((cached, torch.zeros(*cached.shape[:2], width - batch.width, dtype=torch.bool)), dim=2)
        input_ids = _pad(batch.input_ids, rows, new)
        position_ids = _pad(batch.position_ids, rows, new)
        masks = [_pad(cached, rows, new), _pad_among(among, rows, new)]
        if batch.window is not None:
            window_cached, window_new = batch.window
            if width > batch.width:
                window_cached = torch.cat((window_cached, torch.zeros(*window_cached.shape[:2], width - batch.width,
                                                                      dtype=torch.bool)), dim=2)
            masks += [masks[0] & _pad(window_cached, rows, new), masks[1] & _pad_among(window_new, rows, new)]
        keys, values = pool.view(rows, width)
        additive = [torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, self._minimum)[:, None].to(device)
                    for mask in masks]
        inputs = [input_ids.to(device), position_ids.to(device), additive[0], additive[1], keys, values]
        inputs += additive[2:] if batch.window is not None else [None, None]
        last = None
        if kind == LOGITS_LAST:
            last = batch.last_index if batch.last_index is not None else torch.zeros(batch.rows, dtype=torch.long)
            last = _pad(last[:, None], rows, 1)[:, 0].to(device)
        return inputs + [last]


def _pad(tensor: torch.Tensor, rows: int, new: int) -> torch.Tensor:
    """Zero-pad dims 0 and 1 of `tensor` up to `rows` x `new`."""
    if tensor.shape[0] == rows and tensor.shape[1] == new:
        return tensor
    padded = tensor.new_zeros(rows, new, *tensor.shape[2:])
    padded[:tensor.shape[0], :tensor.shape[1]] = tensor
    return padded


def _pad_among(among: torch.Tensor, rows: int, new: int) -> torch.Tensor:
    """[R, T, T] -> [rows, new, new]; a padding token sees itself only."""
    if among.shape[0] == rows and among.shape[1] == new:
        return among
    padded = torch.eye(new, dtype=torch.bool).repeat(rows, 1, 1)
    padded[:among.shape[0], :among.shape[1], :among.shape[2]] = among
    return padded
