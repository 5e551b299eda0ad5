"""The engines of one device, stepped in turn: what the engine core does all day.

One `BatchedSpeculativeEngine` per (target, draft) pair; `step()` steps each engine with work
once and reports what each step did (`protocol.StepReport`). The engine core process runs one
`LocalEngines` (process.py); a front with ``SPECOPS_ENGINE_CORE=thread`` runs one in its own
batching-loop thread. Django-free.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from collections.abc import Callable, Hashable
from dataclasses import replace

from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.batch.policy import SpeculationPolicy
from inference.engine.batch.runners import CompileSettings
from inference.engine.kv.prefix_cache import PrefixCache
from inference.engine_core.protocol import EngineSettings, Pair, StepReport

logger = logging.getLogger(__name__)

STEP_COST_EXPORT_EVERY = 200  # steps between two exports of the step-cost table (metrics.observe_step_costs)


def compile_settings(settings: EngineSettings) -> CompileSettings:
    """The engine's compile settings from the worker's."""
    return CompileSettings(mode=settings.compile, store=Path(settings.compile_dir) if settings.compile_dir else None,
                           kv_budget_mb=settings.kv_cache_mb, background=settings.compile_background)


class LocalEngines:
    """Builds, feeds and steps the engines of one device in the calling thread."""

    def __init__(self, settings: EngineSettings, models) -> None:
        self.settings = settings
        self.models = models  # a models.ModelResidency: what `drop` unloads
        self.engines: dict[Pair, BatchedSpeculativeEngine] = {}
        self._pair_of: dict[Hashable, Pair] = {}  # request id -> its engine's pair
        # one store for the device, bounded as a whole; each pair's engine has its own namespace
        self.prefix_cache = PrefixCache(settings.prefix_cache_mb * 1024 * 1024, settings.prefix_cache_block)

    def submit(self, pair: Pair, request: BatchRequest, target, draft, dspark) -> None:
        """Hand a request to its pair's engine (built on first use); raises what the engine refuses."""
        engine = self.engines.get(pair)
        if engine is None:
            settings = self.settings
            # LoadedModels: the engine checks that the pair shares a tokenizer and EOS
            engine = BatchedSpeculativeEngine(
                target, draft, decode=target.tokenizer.decode,
                # the confidence scheduler decides from the drafts' values as they are drawn (reads of
                # the device at every position): on a GPU, where a verify's width is nearly free,
                # the fixed-depth policy's one-read steps (batch/device_step.py) pay more
                policy=SpeculationPolicy(enabled=settings.policy_enabled,
                                         confidence_scheduling=target.model.device.type != "cuda"),
                max_rows=settings.max_rows, prefill_chunk=settings.prefill_chunk or None,
                prefill=settings.prefill_mode, dspark=dspark, pack_linear=settings.pack_linear,
                prefix_cache=self.prefix_cache, prefix_namespace=pair, compile=compile_settings(settings))
            self.engines[pair] = engine
        engine.submit(request)
        self._pair_of[request.request_id] = pair

    def cancel(self, request_id: Hashable) -> None:
        """The row leaves at its engine's next step (with finish reason "cancelled")."""
        pair = self._pair_of.get(request_id)
        engine = self.engines.get(pair) if pair is not None else None
        if engine is not None:
            engine.cancel(request_id)

    def has_work(self) -> bool:
        return any(engine.has_work() for engine in self.engines.values())

    def idle_pairs(self) -> list[Pair]:
        return [pair for pair, engine in self.engines.items() if not engine.has_work()]

    def step(self, wait: bool = False, send: Callable[[StepReport], None] | None = None) -> list[StepReport]:
        """One step of every engine with work (``wait`` is the core client's; stepping here never
        waits). A step's early report (its newcomers' first tokens, before the batch's decode
        forward: BatchedSpeculativeEngine.step) goes to ``send`` at once, or first in the list."""
        reports: list[StepReport] = []
        for pair, engine in list(self.engines.items()):
            if engine.has_work():
                reports.append(self._step(pair, engine, send or reports.append))
        return reports

    def _step(self, pair: Pair, engine, send: Callable[[StepReport], None]) -> StepReport:
        started = time.perf_counter()

        def early(events) -> None:
            self._forget_finished(events)
            # steps: as the step's own report will count it (the engine counts a step once it is done)
            send(StepReport(pair, events, timing=engine.last_step_timing, steps=engine.steps + 1, early=True))

        try:
            events = engine.step(early=early)
        except Exception as error:  # a failed forward fails every session of this engine
            logger.exception("batch step failed; failing its %d sessions", engine.active)
            self.engines.pop(pair, None)
            return StepReport(pair, failure=f"{type(error).__name__}: {error}")
        self._forget_finished(events)
        report = StepReport(pair, events, list(engine.forward_log), timing=engine.last_step_timing,
                            steps=getattr(engine, "steps", 0), seconds=time.perf_counter() - started,
                            prefix_cache=replace(self.prefix_cache.stats) if self.prefix_cache.enabled else None,
                            runners=_runner_stats(engine))
        engine.forward_log.clear()
        if engine.last_decision is not None:
            report.decision_depth = engine.last_decision.depth
            report.running = sum(len(other.rows) for other in self.engines.values())
        policy = getattr(engine, "policy", None)
        if policy is not None and report.steps % STEP_COST_EXPORT_EVERY == 1:  # the first step, then every so often
            report.step_costs = {"target": policy.target_costs, "draft": policy.draft_costs}
        return report

    def _forget_finished(self, events) -> None:
        for event in events:
            if event.finished:
                self._pair_of.pop(event.request_id, None)

    def drop(self, pairs, keep: frozenset[int] | set[int] = frozenset()) -> list[Pair]:
        """Drop the idle engines of ``pairs`` and unload their versions that no engine left uses and
        that are not in ``keep`` (a promotion otherwise left every old pair's weights in memory).
        An engine with rows stays. Returns the pairs dropped."""
        dropped = [pair for pair in pairs if pair in self.engines and not self.engines[pair].has_work()]
        for pair in dropped:
            del self.engines[pair]
            # a retired pair's prefixes can never be adopted again
            self.prefix_cache.drop_namespace_where(lambda namespace: namespace[0] == pair)
        still_used = {version for pair in self.engines for version in pair}
        for version_id in {version for pair in dropped for version in pair}:
            if version_id is not None and version_id not in still_used and version_id not in keep:
                self.models.evict(version_id)
        return dropped

    def replay(self, target, prompt_ids, config) -> list[int]:
        """The target's own greedy tokens, no drafter, no batch (the losslessness canary)."""
        from inference.engine.decode.target_only import generate_plain

        return list(generate_plain(target.model, list(prompt_ids), config,
                                   decode=target.tokenizer.decode).token_ids)


def _runner_stats(engine):
    """The compiled forwards' stats of an engine that has runners (a test's stand-in engine has none)."""
    runners = getattr(engine, "runners", None)
    return runners.snapshot() or None if runners is not None else None
