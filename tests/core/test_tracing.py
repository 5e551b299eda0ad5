"""One generation, one trace: API request -> broker -> a real Celery worker -> PostgreSQL and Redis.

The API side runs in this process (the Django test client) with an in-memory exporter; the worker
is a real ``celery worker`` process with ``SPECOPS_TRACING=console`` writing its spans as JSON
lines to a file, which the test reads back. Both sides together must form one tree rooted at the
request's server span.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
from django.db import connections

from core import tracing
from specops.celery import app
from tests.helpers import wait_for
from tests.worker_process import ROOT, start_worker, stop_worker

pytestmark = pytest.mark.django_db(transaction=True)


@dataclass(frozen=True)
class S:
    """A finished span from either side, in one shape."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    start: str  # ISO 8601, as both sides write it
    end: str
    attributes: dict


def from_memory(span) -> S:
    from opentelemetry.sdk.util import ns_to_iso_str

    return S(span.name, f"0x{span.context.trace_id:032x}", f"0x{span.context.span_id:016x}",
             f"0x{span.parent.span_id:016x}" if span.parent else None, ns_to_iso_str(span.start_time),
             ns_to_iso_str(span.end_time), dict(span.attributes or {}))


def from_json(line: str) -> S:
    data = json.loads(line)
    return S(data["name"], data["context"]["trace_id"], data["context"]["span_id"], data["parent_id"],
             data["start_time"], data["end_time"], data["attributes"])


def statement(span: S) -> str:
    return str(span.attributes.get("db.statement") or span.attributes.get("db.query.text") or span.name)


def stop_tracing() -> None:
    """Stop recording and take the instrumentations off, so the rest of the suite runs untraced
    (a process's end flushes by itself: only the tests turn tracing off)."""
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    with tracing._configure_lock:
        if not tracing._enabled:
            return
        for instrumentor in (DjangoInstrumentor(), CeleryInstrumentor(), PsycopgInstrumentor(), RedisInstrumentor()):
            if instrumentor.is_instrumented_by_opentelemetry:
                instrumentor.uninstrument()
        provider = trace.get_tracer_provider()
        if hasattr(provider, "force_flush"):
            provider.force_flush()
        tracing._enabled = False


@pytest.fixture(scope="module")
def exporter(django_db_setup):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    assert tracing.configure_tracing("specops-test", exporter=memory)
    for connection in connections.all():  # pooled connections opened before the instrumentation
        connection.close()
        if hasattr(connection, "close_pool"):
            connection.close_pool()
    yield memory
    stop_tracing()
    for connection in connections.all():
        connection.close()
        if hasattr(connection, "close_pool"):
            connection.close_pool()


@pytest.fixture(scope="module")
def spans_file(tmp_path_factory):
    return tmp_path_factory.mktemp("spans") / "worker-spans.jsonl"


@pytest.fixture(scope="module")
def traced_worker(django_db_setup, tmp_path_factory, spans_file):
    app.control.purge()
    process = start_worker("cpu", "trace-cpu", tmp_path_factory.mktemp("worker") / "worker.log",
                           extra_env={"SPECOPS_TRACING": "console", "SPECOPS_TRACING_CONSOLE_PATH": str(spans_file)})
    yield process
    stop_worker(process)


def finished(api_client, session_id):
    body = api_client.get(f"/api/v1/sessions/{session_id}/").json()
    return body if body["status"] in ("succeeded", "failed") else None


def worker_spans(path, trace_id: str) -> list[S]:
    if not path.exists():
        return []
    return [span for line in path.read_text().splitlines() if line.strip()
            for span in [from_json(line)] if span.trace_id == trace_id]


def test_one_generation_is_one_trace_from_the_request_to_the_batch_writes(
        exporter, api_client, tiny_model, traced_worker, spans_file):
    exporter.clear()
    created = api_client.post("/api/v1/generations/", {"prompt": "def parse(text):\n    ", "max_new_tokens": 24,
                                                       "drafter": "draft_model"}, format="json")
    assert created.status_code == 202, created.content
    session_id = str(created.json()["id"])
    api = [from_memory(span) for span in exporter.get_finished_spans()]

    # the request: one server span, the root, with a span per component of the path
    roots = [span for span in api if span.parent_id is None]
    assert len(roots) == 1, [s.name for s in roots]
    root = roots[0]
    assert "generations" in root.name and root.name.startswith("POST")
    trace_id = root.trace_id
    assert {span.trace_id for span in api} == {trace_id}
    by_name = {span.name: span for span in api}
    for name in ("specops.auth", "specops.validation", "specops.prediction_cache", "specops.session_write",
                 "specops.enqueue"):
        assert by_name[name].parent_id == root.span_id, name
    insert = [span for span in api if span.parent_id == by_name["specops.session_write"].span_id
              and 'INSERT INTO "metadata_session"' in statement(span)]
    assert insert, "the session row's INSERT is traced under specops.session_write"
    publish = by_name["apply_async/sessions.generate"]
    assert publish.parent_id == by_name["specops.enqueue"].span_id

    body = wait_for(lambda: finished(api_client, session_id), timeout=120, what="the generation to finish")
    assert body["status"] == "succeeded", body["error"]
    # the task span ends when the task returns, a moment after the session's end
    worker = wait_for(lambda: (lambda spans: spans if any(s.name == "run/sessions.generate" for s in spans)
                               else None)(worker_spans(spans_file, trace_id)),
                      timeout=30, what="the worker's task span in the spans file")

    # the worker continues the request's trace: the task's span is the enqueue's child
    task = next(span for span in worker if span.name == "run/sessions.generate")
    assert task.parent_id == publish.span_id
    names = [span.name for span in worker]
    queue_wait = next(span for span in worker if span.name == "specops.queue_wait")
    inference = next(span for span in worker if span.name == "specops.inference")
    assert queue_wait.parent_id == task.span_id and inference.parent_id == task.span_id
    assert inference.attributes["specops.session"] == session_id
    assert inference.attributes["specops.status"] == "succeeded"
    assert queue_wait.start <= task.start

    # per step: prefill, then draft and verify, each a child of the session's inference span
    steps = {name: [span for span in worker if span.name == name and span.parent_id == inference.span_id]
             for name in ("specops.prefill", "specops.draft", "specops.verify", "specops.batch_write")}
    assert steps["specops.prefill"] and steps["specops.draft"] and steps["specops.batch_write"], names
    assert len(steps["specops.verify"]) == body["stats"]["steps"]
    step_of = lambda span: span.attributes["specops.engine.step"]  # noqa: E731
    assert min(map(step_of, steps["specops.prefill"])) <= min(map(step_of, steps["specops.draft"]))
    verify_of_step = {step_of(span): span for span in steps["specops.verify"]}
    for draft in steps["specops.draft"]:
        verify = verify_of_step[step_of(draft)]
        assert draft.end <= verify.start  # the step drafted, then verified
        assert inference.start <= draft.start and verify.end <= inference.end
    # the batch writes' statements hang under specops.batch_write; the stream's fenced publishes under inference
    writes = {span.span_id for span in steps["specops.batch_write"]}
    assert any(span.parent_id in writes and 'INSERT INTO "metadata_token"' in statement(span) for span in worker)
    # the stream's publishes are fenced (one Lua script per publish: EVALSHA, or EVAL on a cold cache)
    names = [statement(span).upper() for span in worker if span.parent_id == inference.span_id]
    assert any(name.startswith(("EVALSHA", "EVAL")) or "XADD" in name for name in names), names

    # one tree: every span of the trace has its parent in the trace, and only the request is a root
    known = {span.span_id for span in api + worker}
    assert [span.name for span in api + worker if span.parent_id not in known] == [root.name]


def test_tracing_off_is_the_no_op_tracer():
    """Without SPECOPS_TRACING the web process installs nothing: OpenTelemetry's proxy provider."""
    probe = ("import specops.asgi; from opentelemetry import trace; from core import tracing; "
             "print(type(trace.get_tracer_provider()).__name__, tracing.enabled(), tracing.session_trace('x', None))")
    env = {key: value for key, value in __import__("os").environ.items() if not key.startswith("SPECOPS_TRACING")}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ProxyTracerProvider", "False", "None"]


def test_an_unknown_exporter_is_refused_at_startup():
    env = {**__import__("os").environ, "SPECOPS_TRACING": "jaeger"}
    out = subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**env, "DJANGO_SETTINGS_MODULE": "specops.settings"})
    assert out.returncode != 0
    assert "SPECOPS_TRACING='jaeger': expected one of off, console, otlp." in out.stderr
