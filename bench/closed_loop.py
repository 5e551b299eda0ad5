"""A closed loop of requests on the batched engine, and what one run of it measured (bench/serving.py,
bench/serving_api.py): c requests in flight, each one that ends replaced by the next."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from inference.engine import DraftConfig
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.worker.metrics import inter_token_gaps


@dataclass
class Run:
    """One method at one concurrency: outputs, wall time, per-request latencies."""

    method: str
    concurrency: int
    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return sum(len(o) for o in self.outputs) / self.seconds if self.seconds else 0.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_batched(name, engine: BatchedSpeculativeEngine, prompts, generation, drafter, gamma,
                concurrency: int | None = None) -> Run:
    """Keep `concurrency` requests in the engine (all of them when None) until every one ended."""
    concurrency = concurrency or len(prompts)
    run = Run(name, concurrency)
    tokens = {index: [] for index in range(len(prompts))}
    times = {index: [] for index in range(len(prompts))}
    counts = {index: [] for index in range(len(prompts))}
    arrivals: dict[int, float] = {}
    queued = list(range(len(prompts)))

    def submit(index: int) -> None:
        arrivals[index] = time.perf_counter()
        engine.submit(BatchRequest(index, prompts[index], generation, drafter, DraftConfig(length=gamma)))

    started = time.perf_counter()
    for index in queued[:concurrency]:
        submit(index)
    queued = queued[concurrency:]
    while engine.has_work():
        for event in engine.step():
            if event.step.token_ids:
                tokens[event.request_id].extend(event.step.token_ids)
                times[event.request_id].append(time.perf_counter())
                counts[event.request_id].append(len(event.step.token_ids))
            if event.finished and queued:
                submit(queued.pop(0))
    run.seconds = time.perf_counter() - started
    for index in range(len(prompts)):
        run.outputs.append(tokens[index])
        run.ttft.append(times[index][0] - arrivals[index])
        run.itl.extend(inter_token_gaps(times[index], counts[index]))
    return run
