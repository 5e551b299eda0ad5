"""The latency budget: each component of a generation's path to its first token, measured as a
Prometheus histogram, against a p95 budget from the environment.

An SLO split into a budget per component, so a slow request says where its time went.
Here the path to the first token is::

    auth -> validation -> cache -> db write -> enqueue -> queue wait -> inference -> streaming

measured by (seconds; one observation per request unless said otherwise):

========== ============================================ ==========================================
component  histogram                                    from .. to
========== ============================================ ==========================================
auth       specops_request_component_seconds{auth}      DRF's ``initial`` (token, tenant, throttles);
                                                        OpenAI: ``authorize``
validation specops_request_component_seconds{validation} the serializer (model lookup, tokenizing)
cache      specops_request_component_seconds{cache}     the prediction-cache lookup
db_write   specops_request_component_seconds{db_write}  the session row's transaction
enqueue    specops_request_component_seconds{enqueue}   ``apply_async`` of the task
queue_wait specops_request_queue_time_seconds (worker)  the session's creation to joining its batch
inference  specops_request_component_seconds{inference} joining the batch to the first token
                                                        (worker)
streaming  specops_request_component_seconds{streaming} one streamed step: read off Redis to sent
                                                        (one observation per step, OpenAI streams)
========== ============================================ ==========================================

``queue_wait`` reuses the serving loop's histogram (``inference.worker.metrics``); since it starts at
the session's creation it also holds the row's write and the enqueue (a few ms). Budgets are
``SPECOPS_BUDGET_<COMPONENT>_MS`` (p95, milliseconds); their defaults add up to 930 ms, inside
the time-to-first-token objective of 1 s. The page reads every process's histograms through
``PROMETHEUS_MULTIPROC_DIR`` (web and workers write there; ``scripts/run.sh`` sets it), or this
process's own registry when it is unset (then only what this process measured).

Nothing here imports the inference app (it is imported by it): metrics are found by name.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Histogram

from core import tracing
from core.conf import conf, prometheus_multiproc_dir

QUANTILE = 0.95
BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.45,
           0.6, 0.8, 1, 1.5, 2.5, 5, 10, 30, 60)
COMPONENT_METRIC = "specops_request_component_seconds"
COMPONENT_SECONDS = Histogram(
    COMPONENT_METRIC,
    "Time of one component of a generation's path to its first token (the latency budget).",
    ["component"], buckets=BUCKETS,
)
QUEUE_TIME_METRIC = "specops_request_queue_time_seconds"
TTFT_METRIC = "specops_time_to_first_token_seconds"


@dataclass(frozen=True)
class Component:
    name: str
    label: str
    meaning: str
    metric: str = COMPONENT_METRIC
    span: str | None = None  # the span ``measure`` opens, if any

    @property
    def setting(self) -> str:
        return f"SPECOPS_BUDGET_{self.name.upper()}_MS"

    @property
    def labels(self) -> dict[str, str]:
        return {"component": self.name} if self.metric == COMPONENT_METRIC else {}


COMPONENTS = (
    Component("auth", "auth", "token, tenant and throttles", span="specops.auth"),
    Component("validation", "validation", "the request against its model", span="specops.validation"),
    Component("cache", "cache", "the prediction-cache lookup", span="specops.prediction_cache"),
    Component("db_write", "database write", "the session row", span="specops.session_write"),
    Component("enqueue", "enqueue", "the task to the broker", span="specops.enqueue"),
    Component("queue_wait", "queue wait", "creation to joining the device's batch", metric=QUEUE_TIME_METRIC),
    Component("inference", "inference", "joining the batch to the first token"),
    Component("streaming", "streaming", "one step from Redis to the client"),
)
# the label children, made once (``labels()`` takes a lock per call)
_MEASURED = {c.name: COMPONENT_SECONDS.labels(c.name) for c in COMPONENTS if c.metric == COMPONENT_METRIC}
_SPANS = {c.name: c.span or f"specops.{c.name}" for c in COMPONENTS}


# ----------------------------------------------------------------------------- measuring


def observe(component: str, seconds: float) -> None:
    """Record one measurement of ``component`` (one of ``COMPONENTS``, measured here)."""
    _MEASURED[component].observe(seconds)


@contextmanager
def measure(component: str) -> Iterator[None]:
    """Time the block as ``component`` (an error inside still counts) inside its span."""
    child = _MEASURED[component]
    started = time.perf_counter()
    try:
        with tracing.span(_SPANS[component]):
            yield
    finally:
        child.observe(time.perf_counter() - started)


# ----------------------------------------------------------------------------- reading


def collect() -> list:
    """Every process's metric families (the multiprocess directory), else this process's own."""
    path = prometheus_multiproc_dir()
    if path:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=path)
        return list(registry.collect())
    return list(REGISTRY.collect())


@dataclass
class Distribution:
    """One histogram's cumulative buckets (upper edge in seconds -> count), summed over other labels."""

    buckets: dict[float, float]
    count: float
    total: float

    def quantile(self, q: float) -> float | None:
        """histogram_quantile's rule: linear inside the bucket; the largest finite edge past the last."""
        if not self.count:
            return None
        edges = sorted(self.buckets)
        rank = q * self.count
        lower, below = 0.0, 0.0
        for edge in edges:
            cumulative = self.buckets[edge]
            if cumulative >= rank:
                if math.isinf(edge):
                    return lower
                inside = cumulative - below
                return lower + (edge - lower) * ((rank - below) / inside if inside else 0.0)
            lower, below = edge, cumulative
        return lower

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


def distribution(families: list, metric: str, labels: dict[str, str]) -> Distribution:
    buckets: dict[float, float] = {}
    count = total = 0.0
    for family in families:
        if family.name != metric:
            continue
        for sample in family.samples:
            if any(sample.labels.get(key) != value for key, value in labels.items()):
                continue
            if sample.name == metric + "_bucket":
                edge = float(sample.labels["le"])
                buckets[edge] = buckets.get(edge, 0.0) + sample.value
            elif sample.name == metric + "_count":
                count += sample.value
            elif sample.name == metric + "_sum":
                total += sample.value
    return Distribution(buckets, count, total)


@dataclass(frozen=True)
class BudgetLine:
    component: Component
    budget_ms: float
    count: int
    mean_ms: float | None
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None

    @property
    def over(self) -> bool:
        return self.p95_ms is not None and self.p95_ms > self.budget_ms

    @property
    def state(self) -> str:
        if self.p95_ms is None:
            return "no data"
        return "over budget" if self.over else "within"

    @property
    def used_percent(self) -> float | None:
        return 100.0 * self.p95_ms / self.budget_ms if self.p95_ms is not None and self.budget_ms else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def budget_lines(families: list | None = None) -> list[BudgetLine]:
    """Each component's measured latency against its budget, in the request's order."""
    families = collect() if families is None else families
    lines = []
    for component in COMPONENTS:
        measured = distribution(families, component.metric, component.labels)
        lines.append(BudgetLine(
            component, float(getattr(conf, component.setting)), int(measured.count), _ms(measured.mean),
            _ms(measured.quantile(0.5)), _ms(measured.quantile(QUANTILE)), _ms(measured.quantile(0.99))))
    return lines


def budget_context() -> dict:
    """What the admin's latency-budget page shows."""
    families = collect()
    lines = budget_lines(families)
    ttft = distribution(families, TTFT_METRIC, {})
    measured = [line.p95_ms for line in lines if line.p95_ms is not None]
    return {
        "lines": lines,
        "over": [line for line in lines if line.over],
        "budget_total_ms": sum(line.budget_ms for line in lines),
        "p95_total_ms": sum(measured) if measured else None,
        "ttft_p95_ms": _ms(ttft.quantile(QUANTILE)),
        "ttft_count": int(ttft.count),
        "source": prometheus_multiproc_dir() or "this process's registry (PROMETHEUS_MULTIPROC_DIR is unset)",
        "quantile": int(QUANTILE * 100),
    }
