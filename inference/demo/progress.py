"""Where a demo build stands: its phases, its ETA, a line for the terminal, its record in Redis.

A build (`demo:quick-0`, `demo:seed0`) is a long job in its own process (`manage.py
build_demo_models`); `BuildProgress` is its `BuildObserver`: it prints a line to the terminal
at each phase and every few seconds, and keeps its record (`inference.build_records`: the phase,
the step, the total, an ETA and the state) up to date. The web process reads it back:
`demo_build_progress()` for the admin dashboard, `inference.registry.pending_build` for the API
(a request for a model still being built is a 503).
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import redis

from inference.build_records import (
    BUILDING,
    DONE,
    FAILED,
    INTERRUPTED,
    STALLED,
    build_records,
    write_build_record,
)

logger = logging.getLogger(__name__)

#: Seconds each phase took on the default config (used only for the overall percent and ETA: the
#: phases after the current one are estimated from the current one's measured rate). The pair's
#: phases, then its DSpark drafter's (the full build's last phase: 708 s for 714 steps).
PHASE_SECONDS = {"tokenizer_and_data": 12, "train_target": 414, "target_greedy_text": 27,
                 "distil_draft": 126, "save_and_evaluate": 21, "dspark_text": 60, "train_dspark": 708}
PAIR_PHASES = ("tokenizer_and_data", "train_target", "target_greedy_text", "distil_draft", "save_and_evaluate")
DSPARK_PHASES = ("dspark_text", "train_dspark")
PHASE_ORDER = PAIR_PHASES  # a build without a DSpark drafter (the quick pair)


def phase_shares(phases: tuple[str, ...]) -> dict[str, float]:
    """Each phase's share of a build that runs ``phases``."""
    total = sum(PHASE_SECONDS[phase] for phase in phases)
    return {phase: PHASE_SECONDS[phase] / total for phase in phases}


PHASE_SHARES = phase_shares(PAIR_PHASES)


def build_phases(config) -> tuple[str, ...]:
    """The phases a build of ``config`` (a DemoBuildConfig) runs: the pair's, then its DSpark
    drafter's when it trains one."""
    return PAIR_PHASES + DSPARK_PHASES if getattr(config, "dspark", None) is not None else PAIR_PHASES
#: Phases that report every step (the others report batches), so a first report past step 1
#: means the phase resumed from a checkpoint.
STEPWISE_PHASES = ("train_target", "distil_draft")


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "time left unknown"
    if seconds < 90:
        return f"about {max(1, round(seconds))} s left"
    return f"about {round(seconds / 60)} min left"


def describe(record: dict[str, Any]) -> str:
    """One line: `demo:seed0 building: train_target 120/500 (phase 2/5), about 6 min left`."""
    head = f"{record['name']}:{record['version']} {record['state']}"
    if record["state"] == DONE:
        return f"{head} in {record.get('elapsed_s', 0):.0f} s"
    if record["state"] in (FAILED, INTERRUPTED):
        return f"{head}: {record.get('message') or 'see var/log/demo-build.log'}"
    if not record.get("phase"):
        return f"{head}: starting"
    phases = record.get("phases") or PHASE_ORDER
    where = f"{record['phase']} {record['step']}/{record['total']} (phase {record['phase_index'] + 1}/{len(phases)})"
    return f"{head}: {where}, {format_duration(record.get('eta_s'))}"


class BuildProgress:
    """Records and prints the progress of one build; pass it to `build_demo_models(observer=)`."""

    def __init__(self, name: str, version: str, *, stream: TextIO | None = sys.stdout,
                 print_every_s: float = 15.0, write_every_s: float = 2.0,
                 phase_limits_s: dict[str, float] | None = None,
                 client: redis.Redis | None = None, clock: Callable[[], float] = time.time,
                 phases: tuple[str, ...] = PAIR_PHASES) -> None:
        """`phase_limits_s`: phases with a time budget (the quick pair's target), for the ETA;
        `phases`: those the build runs (PAIR_PHASES + DSPARK_PHASES for a full build)."""
        self.name, self.version = name, version
        self.phases, self.shares = tuple(phases), phase_shares(tuple(phases))
        self.phase_limits_s = phase_limits_s or {}
        self.stream, self.print_every_s, self.write_every_s = stream, print_every_s, write_every_s
        self._client, self.clock = client, clock
        self._printed_at = self._written_at = 0.0
        self._phase_clock = 0.0
        self._first_step: int | None = None  # the first step counted by this process in the phase
        now = clock()
        self.record: dict[str, Any] = {
            "name": name, "version": version, "state": BUILDING, "phase": "", "phase_index": -1,
            "phases": list(self.phases), "step": 0, "total": 0, "percent": 0.0, "eta_s": None,
            "phase_eta_s": None, "started_at": now, "updated_at": now, "elapsed_s": 0.0,
            "resumed": [], "message": "", "pid": os.getpid(), "host": socket.gethostname(),
        }

    # BuildObserver
    def phase_started(self, phase: str, total: int) -> None:
        self._phase_clock = self.clock()
        self._first_step = None
        index = self.phases.index(phase) if phase in self.phases else -1
        self.record.update(phase=phase, phase_index=index, step=0, total=total, phase_eta_s=None)
        self._update(force=True)

    def step_done(self, done: int) -> None:
        if self._first_step is None:
            self._first_step = done
            if done > 1 and self.record["phase"] in STEPWISE_PHASES:  # resumed from a checkpoint
                self.record["resumed"].append({"phase": self.record["phase"], "step": done - 1})
        self.record["step"] = done
        self._update(force=done >= self.record["total"])

    # the job's life
    def started(self) -> None:
        self._update(force=True)

    def finished(self, state: str, message: str = "") -> None:
        now = self.clock()
        self.record.update(state=state, message=message, updated_at=now,
                           elapsed_s=round(now - self.record["started_at"], 1),
                           eta_s=0.0 if state == DONE else None, phase_eta_s=0.0 if state == DONE else None)
        if state == DONE:
            self.record["percent"] = 100.0
        self._write()
        self._print(force=True)

    def _estimate(self, now: float) -> None:
        record = self.record
        total, step = record["total"], record["step"]
        record["percent"] = round(self._overall_fraction() * 100, 1)
        counted = 0 if self._first_step is None else step - self._first_step + 1  # by this process
        elapsed = now - self._phase_clock
        if total <= 1 or counted <= 0 or elapsed <= 0:  # an un-counted phase: no rate to go by
            record["phase_eta_s"] = record["eta_s"] = None
            return
        per_step = elapsed / counted
        phase_left = max(0, total - step) * per_step
        phase_full = total * per_step
        limit = self.phase_limits_s.get(record["phase"])
        if limit is not None:
            phase_left, phase_full = min(phase_left, max(0.0, limit - elapsed)), min(phase_full, limit)
        share = self.shares.get(record["phase"])
        later = sum(self.shares[p] for p in self.phases[record["phase_index"] + 1:]) if share else 0.0
        record["phase_eta_s"] = round(phase_left, 1)
        record["eta_s"] = round(phase_left + (phase_full * later / share if share else 0.0), 1)

    def _overall_fraction(self) -> float:
        record = self.record
        if record["phase"] not in self.shares:
            return 0.0
        before = sum(self.shares[p] for p in self.phases[: record["phase_index"]])
        within = record["step"] / record["total"] if record["total"] else 0.0
        return min(1.0, before + self.shares[record["phase"]] * within)

    def _update(self, force: bool = False) -> None:
        now = self.clock()
        self._estimate(now)
        self.record.update(updated_at=now, elapsed_s=round(now - self.record["started_at"], 1))
        if force or now - self._written_at >= self.write_every_s:
            self._write()
            self._written_at = now
        self._print(force=force and self.record["step"] == 0)

    def _print(self, force: bool = False) -> None:
        now = self.clock()
        if self.stream is None or not (force or now - self._printed_at >= self.print_every_s):
            return
        self._printed_at = now
        self.stream.write(f"demo build {describe(self.record)}\n")
        self.stream.flush()

    def _write(self) -> None:
        try:
            write_build_record(self.record, self._client)
        except redis.RedisError as exc:  # the build goes on; only its record is missing
            logger.warning("could not record demo build progress in Redis: %s", exc)


def demo_build_progress(name: str = "demo") -> dict[str, Any] | None:
    """The demo build an operator wants to see: the one running, else the latest; None if none.

    A dict with `name`, `version`, `state` (building, done, failed, interrupted, stalled),
    `phase` (one of `phases`), `phase_index`, `step`/`total` of that phase, `percent` (of the
    whole build, estimated), `eta_s` (whole build, estimated; None until measured),
    `phase_eta_s`, `started_at`/`updated_at` (epoch seconds), `elapsed_s`, `age_s` (since the
    last update), `resumed` (where a killed build picked up), `message` and `line` (one line
    for humans, as the terminal shows it).
    """
    records = build_records(name)
    if not records:
        return None
    running = [r for r in records if r["state"] in (BUILDING, STALLED)]
    record = running[0] if running else records[0]
    record["line"] = describe(record)
    return record
