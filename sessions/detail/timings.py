"""A session's latencies as its client saw them: queue wait, TTFT, inter-token latency, end to end.

TTFT and ITL are measured like the worker's Prometheus histograms (``inference.worker.metrics``):
from the session's creation to its first streamed step, and one ITL sample per token, a step's
gap shared by its tokens. They come from the session's ``stats`` when the worker recorded them
there (``ttft_seconds``, ``itl_seconds``: the mean per-token gap), else from the token stream's
entry ids (Redis stamps each entry with the millisecond it was appended; the stream lives an hour
after its last write), else they are unknown. The queue wait is creation to the worker's start.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime

from sessions.streams import token_stream


@dataclass(frozen=True)
class SessionTimings:
    queue_seconds: float | None = None
    ttft_seconds: float | None = None
    itl_mean_seconds: float | None = None
    # per-token gaps (seconds, weight in tokens) when read from the stream; empty otherwise
    itl_samples: list[tuple[float, int]] = field(default_factory=list)
    e2e_seconds: float | None = None
    source: str = "none"  # "stats" | "stream" | "none": where TTFT and ITL came from


def _seconds(later: datetime | None, earlier: datetime | None) -> float | None:
    return (later - earlier).total_seconds() if later and earlier else None


def step_times_from_stream(entries: list[tuple[bytes | str, dict]]) -> list[tuple[float, int]]:
    """(append time in seconds, tokens) of each ``tokens`` entry of a raw XRANGE answer."""
    steps = []
    for entry_id, fields in entries:
        fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
        event = fields.get("event")
        if (event.decode() if isinstance(event, bytes) else event) != "tokens":
            continue
        data = json.loads(fields.get("data") or "{}")
        ident = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        steps.append((int(ident.split("-")[0]) / 1000, len(data.get("token_ids") or ())))
    return steps


def timings_from_steps(created_at: datetime, steps: list[tuple[float, int]]) -> tuple[float | None, list]:
    """TTFT and per-token ITL samples from (time, tokens) of each streamed step (vLLM's rule)."""
    steps = [(at, tokens) for at, tokens in steps if tokens > 0]
    if not steps:
        return None, []
    ttft = steps[0][0] - created_at.timestamp()
    samples = [((at - previous) / tokens, tokens) for (previous, _), (at, tokens) in zip(steps, steps[1:])]
    return ttft, samples


def timings_of(session, stream_entries: list | None = None, read_stream: bool = True) -> SessionTimings:
    """The session's timings; ``stream_entries`` is its XRANGE answer if the caller fetched it."""
    stats = session.stats or {}
    common = {"queue_seconds": _seconds(session.started_at, session.created_at),
              "e2e_seconds": _seconds(session.finished_at, session.created_at)}
    if stats.get("ttft_seconds") is not None:
        return SessionTimings(ttft_seconds=float(stats["ttft_seconds"]), itl_mean_seconds=stats.get("itl_seconds"),
                              source="stats", **common)
    if stream_entries is None and read_stream:
        try:
            stream_entries = token_stream.client().xrange(token_stream.stream_key(session.pk))
        except Exception:  # Redis down: the timings are unknown, the page still renders
            stream_entries = []
    ttft, samples = timings_from_steps(session.created_at, step_times_from_stream(stream_entries or []))
    if ttft is None:
        return SessionTimings(**common)
    weight = sum(tokens for _, tokens in samples)
    mean = sum(gap * tokens for gap, tokens in samples) / weight if weight else None
    return SessionTimings(ttft_seconds=ttft, itl_mean_seconds=mean, itl_samples=samples, source="stream", **common)


def streams_of(session_ids: list) -> dict:
    """XRANGE of many sessions' streams in one pipeline (the rollup job's batch)."""
    if not session_ids:
        return {}
    pipe = token_stream.client().pipeline(transaction=False)
    for session_id in session_ids:
        pipe.xrange(token_stream.stream_key(session_id))
    return dict(zip(session_ids, pipe.execute()))
