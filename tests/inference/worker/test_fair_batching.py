"""The batching loop's side of fairness across tenants (issue 29).

The loop hands the engine each session's tenant as its fair group (the engine's fair admission
and preemption are tested on the engine, tests/inference/engine/test_fair_admission.py), and a
step's stream events go out on a publisher thread of their own: a writer held up by PostgreSQL
(or by a flood of other sessions' ends) no longer holds back a session's tokens on its stream.
Real PostgreSQL and Redis; the engine is scripted (test_write_behind.py's).
"""
from __future__ import annotations

import pytest

from metadata.models import Session, TokenRecord
from tests.helpers import wait_for
from tests.inference.worker.test_write_behind import (  # noqa: F401 (fixtures)
    STEP_TOKENS,
    ScriptedEngine,
    a_write_waits_on_the_lock,
    assert_ended_once,
    checks_read_the_primary,
    hand_over,
    new_loop,
    stepping,
    stream_events,
    target,
    token_table_locked,
)

on_the_services = pytest.mark.django_db(transaction=True, databases="__all__")


@on_the_services
def test_stream_events_go_out_while_the_writer_waits_on_postgresql(settings, tenant, target, new_loop):
    settings.SPECOPS_TOKEN_FLUSH_MS = 1  # a flush after every step
    steps = 6
    loop = new_loop(ScriptedEngine(1, steps))
    [job] = hand_over(loop, tenant, target, 1, max_new_tokens=steps * STEP_TOKENS)
    session_id = job.session.pk
    with token_table_locked():
        loop_thread = stepping(loop)
        wait_for(a_write_waits_on_the_lock, timeout=30, interval=0.02, what="a flush to wait on the lock")
        tokens = lambda: [event for _, event, _ in stream_events(session_id) if event == "tokens"]
        wait_for(lambda: len(tokens()) == steps, timeout=30, interval=0.02, what="every step on the stream")
        # the rows and the end still wait for the lock: a done never comes before the rows
        assert not TokenRecord.objects.filter(session_id=session_id).exists()
        assert [event for _, event, _ in stream_events(session_id)] == ["tokens"] * steps
        assert not job.done.is_set()
    loop_thread.join(30)
    assert job.done.wait(30) and job.status == "succeeded"
    assert_ended_once(job, "succeeded", steps)
    assert TokenRecord.objects.filter(session_id=session_id).count() == steps * STEP_TOKENS


@on_the_services
@pytest.mark.parametrize("fair, preemption", [(True, True), (True, False), (False, True)])
def test_the_loop_hands_the_engine_the_tenant_as_the_fair_group(settings, tenant, target, new_loop, fair,
                                                                 preemption):
    settings.SPECOPS_FAIR_ADMISSION, settings.SPECOPS_PREEMPTION = fair, preemption
    loop = new_loop(ScriptedEngine(1, 1))
    loop._ensure_running = lambda: None  # the test takes the job from the inbox itself
    [job] = hand_over(loop, tenant, target, 1, max_new_tokens=2)
    loop.inbox.get_nowait()
    loop.submit(job)
    request = loop.inbox.get_nowait().request
    assert request.fair_group == (Session.objects.get(pk=job.session.pk).tenant_id if fair else None)
    assert request.preemptible is preemption
