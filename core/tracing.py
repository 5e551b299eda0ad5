"""OpenTelemetry tracing: one trace per generation, from the API request to the worker's writes.

``configure_tracing`` runs once per process at startup (``specops.asgi`` for the web,
``specops.celery``'s worker signals for workers). With ``SPECOPS_TRACING=off`` (the default) it
installs nothing: the global tracer stays OpenTelemetry's no-op proxy, no instrumentation is
applied, and every helper here returns a shared null context after one boolean check. ``console``
writes finished spans as JSON lines (stdout, or ``SPECOPS_TRACING_CONSOLE_PATH``); ``otlp`` sends
them in batches to ``SPECOPS_TRACING_OTLP_ENDPOINT`` (OTLP over HTTP).

Where the spans come from:

* the Django, Celery, psycopg and Redis instrumentations: the request's server span, the enqueue's
  ``apply_async/inference.generate`` span (which puts the context in the task's headers), the
  worker's ``run/inference.generate`` span continuing it, and a span per statement and command;
* ``core.latency_budget.measure`` around each component of the request (``specops.auth``,
  ``specops.validation``, ``specops.prediction_cache``, ``specops.session_write``, ``specops.enqueue``);
* ``SessionTrace`` in the worker. The batching loop runs every session on one thread that has no
  context of its own, so each session carries its trace explicitly: ``specops.queue_wait`` (from
  the enqueue to the task's start) and ``specops.inference`` (from the hand-over to the loop to
  the session's end) are children of the task's span; every step the session took part in adds
  ``specops.prefill`` / ``specops.draft`` / ``specops.verify`` children of ``specops.inference``
  with the step's measured start and end (``BatchedSpeculativeEngine.last_step_timing``: the engine
  reports timings and knows nothing of tracing). One engine step serves every row of the batch, so
  each session gets its own copy of the step's spans, parented in its own trace and marked with
  the step number and ``specops.batch.rows``: a session's trace then reads as its own timeline,
  and the same step number across traces shows what was shared. A flush of the shared batch
  writer opens ``specops.batch_write`` in the trace of every session with rows in it; the first is
  current during the flush, so the INSERT statements' spans hang under it.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

logger = logging.getLogger(__name__)

EXPORTERS = ("off", "console", "otlp")
TRACER_NAME = "specops"

_enabled = False
_configure_lock = threading.Lock()
_tracer: Any = None
_NULL = contextlib.nullcontext()


def enabled() -> bool:
    """Whether spans are recorded in this process (False: every helper here is a no-op)."""
    return _enabled


def exporter_error(value: str) -> str | None:
    """Why ``value`` is not a valid SPECOPS_TRACING, or None."""
    if value.strip().lower() in EXPORTERS:
        return None
    return f"SPECOPS_TRACING={value!r}: expected one of {', '.join(EXPORTERS)}."


def configure_tracing(service_name: str, exporter: Any = None) -> bool:
    """Install the tracer provider and the instrumentations once; return whether tracing is on.

    ``exporter`` (a SpanExporter, exported synchronously) overrides the environment's choice:
    tests pass an in-memory exporter.
    """
    global _enabled, _tracer
    with _configure_lock:
        if _enabled:
            return True
        if exporter is None:
            from core.conf import conf

            choice = conf.TRACING.strip().lower()
            if choice == "off":
                return False
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        if exporter is not None:
            processor = SimpleSpanProcessor(exporter)
            ratio = 1.0
        else:
            processor = _processor(choice, conf, BatchSpanProcessor, SimpleSpanProcessor)
            ratio = conf.TRACING_SAMPLE_RATIO
        provider = trace.get_tracer_provider()
        if not hasattr(provider, "add_span_processor"):  # the API's proxy: no SDK provider yet
            provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                      sampler=ParentBased(TraceIdRatioBased(ratio)))
            trace.set_tracer_provider(provider)
        provider.add_span_processor(processor)
        _instrument()
        _tracer = trace.get_tracer(TRACER_NAME)
        _enabled = True
        logger.info("tracing on (%s) for %s", type(processor.span_exporter).__name__, service_name)
        return True


def _processor(choice: str, conf, batch, simple):
    if choice == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        path = conf.TRACING_CONSOLE_PATH
        out = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (held for the process)
        kwargs = {"out": out} if out else {}
        # one JSON object a line; exported as each span ends (a diagnostic exporter)
        return simple(ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + "\n", **kwargs))
    if choice == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return batch(OTLPSpanExporter(endpoint=conf.TRACING_OTLP_ENDPOINT))
    raise ValueError(exporter_error(choice))


def _instrument() -> None:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    for instrumentor in (DjangoInstrumentor(), CeleryInstrumentor(), PsycopgInstrumentor(), RedisInstrumentor()):
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument()


# ----------------------------------------------------------------------------- spans


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager:
    """A child span of the current one, current inside the block (no-op while tracing is off)."""
    if not _enabled:
        return _NULL
    return _tracer.start_as_current_span(name, attributes=attributes or None)


def untraced() -> contextlib.AbstractContextManager:
    """Instrumentations record nothing inside (housekeeping that serves every session)."""
    if not _enabled:
        return _NULL
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    return suppress_instrumentation()


def time_ns(at: datetime | float) -> int:
    """Nanoseconds since the epoch of a datetime or of a ``time.time()`` value."""
    seconds = at.timestamp() if isinstance(at, datetime) else at
    return int(seconds * 1e9)


class SessionTrace:
    """One session's spans in the worker, parented explicitly (the batching loop has no context).

    Created on the session's task thread, where the Celery instrumentation's task span is current.
    """

    def __init__(self, session_id: str, enqueued_at: datetime | None) -> None:
        from opentelemetry import trace

        task_span = trace.get_current_span()
        task_start = getattr(task_span, "start_time", None)
        if enqueued_at is not None and task_start:
            queued = _tracer.start_span("specops.queue_wait", start_time=time_ns(enqueued_at),
                                        attributes={"specops.session": session_id})
            queued.end(end_time=max(task_start, time_ns(enqueued_at)))
        self.span = _tracer.start_span("specops.inference", attributes={"specops.session": session_id})
        self.context = trace.set_span_in_context(self.span)

    def child(self, name: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
        """A finished child of ``specops.inference`` with measured start and end."""
        _tracer.start_span(name, context=self.context, start_time=start_ns,
                           attributes=attributes or None).end(end_time=end_ns)

    def start_child(self, name: str, **attributes: Any):
        return _tracer.start_span(name, context=self.context, attributes=attributes or None)

    def end(self, status: str) -> None:
        self.span.set_attribute("specops.status", status)
        self.span.end()


def session_trace(session_id, enqueued_at: datetime | None) -> SessionTrace | None:
    """The session's trace in the worker, or None while tracing is off."""
    if not _enabled:
        return None
    return SessionTrace(str(session_id), enqueued_at)


def activated(session: SessionTrace | None) -> contextlib.AbstractContextManager:
    """Make the session's ``specops.inference`` span current (its writes and publishes hang under it)."""
    if session is None:
        return _NULL
    from opentelemetry import context

    return _attached(context, session.context)


@contextlib.contextmanager
def _attached(context_api, ctx) -> Iterator[None]:
    token = context_api.attach(ctx)
    try:
        yield
    finally:
        context_api.detach(token)


@contextlib.contextmanager
def _batch_write(sessions: list[SessionTrace], rows: int) -> Iterator[None]:
    spans = [session.start_child("specops.batch_write", **{"specops.write.rows": rows,
                                                           "specops.write.sessions": len(sessions)})
             for session in sessions]
    from opentelemetry import trace

    try:
        with trace.use_span(spans[0], end_on_exit=False):
            yield
    finally:
        for each in spans:
            each.end()


def batch_write(sessions: Iterable[SessionTrace | None], rows: int) -> contextlib.AbstractContextManager:
    """``specops.batch_write`` in the trace of each session with rows in this flush."""
    if not _enabled:
        return _NULL
    traced = [session for session in sessions if session is not None]
    return _batch_write(traced, rows) if traced else _NULL
