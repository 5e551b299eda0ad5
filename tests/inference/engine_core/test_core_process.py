"""The engine core as its front sees it (inference/engine_core/): a real core process over ZMQ.

What the core steps is what the engines give in this process: greedy rows the same tokens,
whoever they share the batch with; requests sent together are admitted together (their first
events come in one step); a core that dies is noticed and started again.
"""
from __future__ import annotations

import os
import signal
import uuid

import pytest

from inference.engine.batch.engine import BatchRequest
from inference.engine.config import GenerationConfig
from inference.engine_core.client import CoreClient, CoreRestarted, RemoteModel
from inference.engine_core.engines import LocalEngines
from inference.engine_core.model_residency import ModelResidency
from inference.engine_core.protocol import EngineSettings, ModelSpec, Refused, StepReport
from tests.helpers import wait_for

PROMPTS = ["def parse(text):\n    ", "class Node:\n    ", "import os\n", "for i in range(10):\n    "]
SETTINGS = EngineSettings(max_rows=8, policy_enabled=True)


@pytest.fixture
def specs(tiny_model_dirs):
    target_dir, draft_dir = tiny_model_dirs
    return (ModelSpec(1, str(target_dir), label="tiny target"), ModelSpec(2, str(draft_dir), label="tiny draft"))


@pytest.fixture(scope="module", autouse=True)
def single_thread_torch():
    """One intra-op thread for the engines run in this process, as in tests/inference/engine: the
    tiny models' forwards on a second thread of a shared 2-core machine mostly wait."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def core(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the core process's torch: one thread too
    client = CoreClient(SETTINGS)
    yield client
    client.close()


def requests(tokenizer, drafters, max_new_tokens=24):
    return [BatchRequest(request_id=uuid.uuid4(), prompt_ids=tokenizer(prompt)["input_ids"],
                         config=GenerationConfig(max_new_tokens=max_new_tokens), drafter=drafter)
            for prompt, drafter in zip(PROMPTS, drafters)]


def run_to_end(host, pending: set, timeout: float = 120) -> tuple[dict, list]:
    """Step ``host`` until every request in ``pending`` finished: ({request id: tokens}, reports)."""
    tokens: dict = {}
    reports: list = []

    def more() -> bool:
        for report in host.step(wait=True):
            reports.append(report)
            assert not isinstance(report, Refused), report.error
            if isinstance(report, StepReport):
                assert not report.failure, report.failure
                for event in report.events:
                    tokens.setdefault(event.request_id, []).extend(event.step.token_ids)
                    if event.finished:
                        pending.discard(event.request_id)
        return not pending

    wait_for(more, timeout=timeout, interval=0, what="the rows to finish")
    return tokens, reports


def test_greedy_rows_in_the_core_give_what_the_engine_gives_in_process(core, specs):
    target_spec, draft_spec = specs
    local_models = ModelResidency(capacity=4)
    target, draft = local_models.get(target_spec), local_models.get(draft_spec)
    drafters = ["draft_model", "ngram", "none", "draft_model"]
    alone = {}
    for request in requests(target.tokenizer, drafters):  # each alone, in this process
        engine = LocalEngines(SETTINGS, local_models)
        engine.submit((1, 2), request, target, draft, None)
        got, _ = run_to_end(engine, {request.request_id})
        alone[request.prompt_ids[-1], request.drafter] = got[request.request_id]

    remote_target = RemoteModel(target_spec, target.tokenizer)
    remote_draft = RemoteModel(draft_spec, target.tokenizer)
    batch = requests(target.tokenizer, drafters)
    for request in batch:  # sent together: the core admits them at one step boundary
        core.submit((1, 2), request, remote_target, remote_draft, None)
    got, reports = run_to_end(core, {request.request_id for request in batch})
    for request in batch:
        assert got[request.request_id] == alone[request.prompt_ids[-1], request.drafter], request.drafter
    first = next(report for report in reports if isinstance(report, StepReport) and report.events)
    assert {event.request_id for event in first.events} == {request.request_id for request in batch}, \
        "requests sent together prefill together"
    assert any(report.forward_log for report in reports), "the front gets the forwards for its metrics"


def test_a_request_the_engine_refuses_comes_back_refused_and_the_core_goes_on(core, specs):
    target_spec, draft_spec = specs
    tokenizer = ModelResidency(capacity=1).get(target_spec).tokenizer
    bad = BatchRequest(request_id=uuid.uuid4(), prompt_ids=[1, 2], config=GenerationConfig(max_new_tokens=4),
                       drafter="no-such-drafter")
    missing = ModelSpec(9, "/nonexistent/model", label="missing")
    core.submit((1, 2), bad, RemoteModel(target_spec, tokenizer), RemoteModel(draft_spec, tokenizer), None)
    lost = BatchRequest(request_id=uuid.uuid4(), prompt_ids=[1, 2], config=GenerationConfig(max_new_tokens=4))
    core.submit((9, None), lost, RemoteModel(missing, tokenizer), None, None)
    refused: dict = {}
    wait_for(lambda: refused.update({r.request_id: r.error for r in core.step() if isinstance(r, Refused)})
             or len(refused) == 2, timeout=60, interval=0, what="two refusals")
    assert "no-such-drafter" in refused[bad.request_id]
    assert "/nonexistent/model" in refused[lost.request_id]
    [good] = requests(tokenizer, ["ngram"], max_new_tokens=8)
    core.submit((1, 2), good, RemoteModel(target_spec, tokenizer), RemoteModel(draft_spec, tokenizer), None)
    got, _ = run_to_end(core, {good.request_id})
    assert len(got[good.request_id]) == 8


def test_a_core_that_dies_is_started_again(core, specs):
    first = core.pid
    os.kill(first, signal.SIGKILL)
    restarted = []
    wait_for(lambda: restarted.extend(r for r in core.step() if isinstance(r, CoreRestarted)) or restarted,
             timeout=120, interval=0.05, what="the restart")
    assert restarted[0].pid == core.pid != first and core.restarts == 1
    target_spec, _ = specs
    tokenizer = ModelResidency(capacity=1).get(target_spec).tokenizer
    [request] = requests(tokenizer, ["none"], max_new_tokens=6)
    core.submit((1, None), request, RemoteModel(target_spec, tokenizer), None, None)
    got, _ = run_to_end(core, {request.request_id})
    assert len(got[request.request_id]) == 6


def test_the_replay_runs_in_the_core(core, specs):
    """The losslessness canary's target-only replay, computed where the weights are."""
    target_spec, _ = specs
    local = ModelResidency(capacity=1).get(target_spec)
    engine = LocalEngines(SETTINGS, None)
    prompt = local.tokenizer(PROMPTS[0])["input_ids"]
    config = GenerationConfig(max_new_tokens=12)
    expected = engine.replay(local, prompt, config)
    import threading

    answer: list = []
    asking = threading.Thread(target=lambda: answer.append(core.replay(RemoteModel(target_spec, local.tokenizer),
                                                                       prompt, config)))
    asking.start()
    wait_for(lambda: core.step() is not None and not asking.is_alive(), timeout=120, interval=0.05,
             what="the replay's answer")  # the loop thread's step delivers it
    assert answer == [expected] and len(expected) == 12


def test_the_core_process_imports_no_django_orm_redis_or_celery():
    import subprocess
    import sys

    from tests.paths import REPO_ROOT

    probe = ("import sys, inference.engine_core.process, inference.engine_core.client\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in\n"
             "      ('django', 'celery', 'kombu', 'redis', 'psycopg', 'rest_framework', 'metadata', 'core')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_newcomers_first_token_is_reported_before_the_batch_decodes(core, specs):
    """A newcomer's prefill-lane token goes out in an early report, ahead of the decode forward of
    the rows already running (which it does not join until the next step), and it is still the
    target's own greedy output."""
    target_spec, draft_spec = specs
    local_models = ModelResidency(capacity=4)
    target, draft = local_models.get(target_spec), local_models.get(draft_spec)
    [newcomer] = requests(target.tokenizer, ["draft_model"], max_new_tokens=8)[:1]
    engine = LocalEngines(SETTINGS, local_models)
    engine.submit((1, 2), newcomer, target, draft, None)
    alone, _ = run_to_end(engine, {newcomer.request_id})

    remote_target = RemoteModel(target_spec, target.tokenizer)
    remote_draft = RemoteModel(draft_spec, target.tokenizer)
    running = requests(target.tokenizer, ["draft_model", "none", "ngram", "draft_model"], max_new_tokens=200)[1:]
    for request in running:
        core.submit((1, 2), request, remote_target, remote_draft, None)
    decoding: list = []
    wait_for(lambda: decoding.extend(report for report in core.step(wait=True) if isinstance(report, StepReport)
                                     and any(event.step.token_ids for event in report.events)) or decoding,
             timeout=60, interval=0, what="the running rows to decode")
    newcomer = requests(target.tokenizer, ["draft_model"], max_new_tokens=8)[0]
    core.submit((1, 2), newcomer, remote_target, remote_draft, None)
    got, reports = run_to_end(core, {newcomer.request_id} | {request.request_id for request in running})
    assert got[newcomer.request_id] == alone[next(iter(alone))]
    steps = [report for report in reports if isinstance(report, StepReport)]
    first = next(index for index, report in enumerate(steps)
                 if any(event.request_id == newcomer.request_id for event in report.events))
    early = steps[first]
    assert early.early and [event.request_id for event in early.events] == [newcomer.request_id], early
    assert len(early.events[0].step.token_ids) == 1 and not early.forward_log  # its first token, no costs
    following = steps[first + 1]  # the same step's decode of the running rows, reported after it
    assert not following.early and following.steps == early.steps
    assert {event.request_id for event in following.events} <= {request.request_id for request in running}


def test_in_the_loops_own_thread_the_early_report_comes_first_in_the_steps_list(specs):
    """SPECOPS_ENGINE_CORE=thread: LocalEngines.step without a sender lists a step's early report
    (the newcomer's first token) before the same step's decode report."""
    target_spec, draft_spec = specs
    local_models = ModelResidency(capacity=4)
    target, draft = local_models.get(target_spec), local_models.get(draft_spec)
    engines = LocalEngines(SETTINGS, local_models)
    running = requests(target.tokenizer, ["draft_model", "none"], max_new_tokens=100)
    for request in running:
        engines.submit((1, 2), request, target, draft, None)
    while not any(event.step.token_ids for report in engines.step() for event in report.events):
        pass
    newcomer = requests(target.tokenizer, ["ngram"] * 3, max_new_tokens=8)[2]  # a prompt of its own
    engines.submit((1, 2), newcomer, target, draft, None)
    reports = engines.step()
    assert [report.early for report in reports] == [True, False]
    assert [event.request_id for event in reports[0].events] == [newcomer.request_id]
    assert {event.request_id for event in reports[1].events} == {request.request_id for request in running}
