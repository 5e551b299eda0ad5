"""A real worker with its engine core (SPECOPS_ENGINE_CORE=process, the default): the core is
the worker's child, a killed core is restarted and its sessions go on in the same run, and a
killed front takes its core with it (its sessions are the reconciler's, test_crash_safety.py)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from metadata.models import Session
from tests.helpers import wait_for
from tests.inference.worker.test_crash_safety import (
    LONG,
    WORKER_ENV,
    assert_ended_once,
    committed,
    generation,
    nonce_prompt,
    stream_steps,
    target_greedy,
)
from tests.test_end_to_end import finished
from tests.worker_process import start_worker, stop_worker

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def core_pids(front_pid: int) -> list[int]:
    """The engine-core processes whose parent is ``front_pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == front_pid and b"inference.engine_core.process" in command:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_killed_core_is_restarted_and_its_sessions_end_once_in_the_same_run(api_client, tiny_model, tmp_path):
    prompts = [nonce_prompt("def parse(text):\n    "), nonce_prompt("class Node:\n    ")]
    expected = [target_greedy(tiny_model.directory, prompt, LONG) for prompt in prompts]
    worker = start_worker("cpu", "core-kill", tmp_path / "core.log", extra_env=WORKER_ENV)
    try:
        [first_core] = wait_for(lambda: core_pids(worker.pid), timeout=60, what="the worker's engine core")
        ids = [generation(api_client, prompt, LONG) for prompt in prompts]
        wait_for(lambda: all(committed(sid) >= 10 for sid in ids), timeout=120, interval=0.02,
                 what="committed tokens")
        os.kill(first_core, signal.SIGKILL)
        assert Session.objects.filter(pk__in=ids, status="running").count() == 2, "ended before the kill"
        bodies = [wait_for(lambda sid=sid: finished(api_client, sid), timeout=180, what="a generation")
                  for sid in ids]
        [second_core] = core_pids(worker.pid)
    finally:
        stop_worker(worker)
    assert second_core != first_core
    for session_id, tokens, body in zip(ids, expected, bodies):
        ended = assert_ended_once(api_client, session_id, tokens)
        assert ended["attempts"] == 1, "the front resubmits to the new core: no second claim"
        streamed, repeats = stream_steps(session_id)
        assert streamed == tokens and repeats == 0, "the stream goes on where it stopped"
    assert "resubmitting 2 session(s)" in (tmp_path / "core.log").read_text()


def test_a_killed_front_takes_its_core_with_it(tiny_model, tmp_path):
    worker = start_worker("cpu", "front-kill", tmp_path / "front.log", extra_env=WORKER_ENV)
    try:
        [core] = wait_for(lambda: core_pids(worker.pid), timeout=60, what="the worker's engine core")
        os.kill(worker.pid, signal.SIGKILL)  # the front alone: its core must not hold the device on
        worker.wait()
        wait_for(lambda: not alive(core), timeout=10, interval=0.1, what="the orphaned core to exit")
    finally:
        if worker.poll() is None:
            stop_worker(worker)
